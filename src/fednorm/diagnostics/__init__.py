"""Training diagnostics the HarmoFL paper plots (Sec. 3.4, Fig. 1, Fig. 6, App. C.3).

- client drift Gamma_i per round (Eq. 9): recorded during local training (``LocalTraining.track_drift``),
  written with each client's training record as ``drift``;
- gradient dissimilarity at the global model (:mod:`.gradients`): FedProx's B-dissimilarity
  sum_k p_k ||grad F_k||^2 / ||grad F||^2 and the mean pairwise distance ||grad F_i - grad F_j|| (the
  constraint eps of HarmoFL's Eq. 8), at every evaluation round;
- loss-landscape slices around the final global model (:mod:`.landscape`): each client's loss on a 2-D plane
  spanned by filter-normalized random directions (Li et al. 2018).

Switched on by the config's ``diagnostics`` section; ``fednorm landscape RUN`` draws the slices of a finished run.
``fednorm bn-stats RUN`` (:mod:`.bn_statistics`, FedWon Fig. 1b / 12) compares each client's BN statistics of its
own data with the running statistics the model holds.
"""
