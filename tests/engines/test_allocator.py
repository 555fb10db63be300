import resource
import subprocess
import sys

import pytest

from fednorm.data.domain import normalize_batch
from fednorm.engines import simulation
from fednorm.engines.allocator import allocator_tunable
from fednorm.engines.simulation import Federation, InProcessEngine
from fednorm.methods import LocalTraining, resolve_method
from fednorm.models import DigitCNN

needs_glibc = pytest.mark.skipif(not allocator_tunable(), reason="the allocator setting is glibc's mallopt")
# Measured in a fresh interpreter each: glibc's heap and thresholds depend on what the process did before.
PROBE = """
import resource, sys, torch
from fednorm.engines.allocator import reuse_freed_memory
reuse_freed_memory(sys.argv[1] == "on")
block = 16 * 2**20  # 64 MiB of float32: above glibc's largest mmap threshold (32 MiB)
torch.empty(block).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):
    torch.empty(block).fill_(1.0)  # allocate, touch every page, free
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults_of_sixteen_blocks(setting: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True)
    return int(done.stdout)


@needs_glibc
def test_reused_memory_serves_the_next_large_block_without_fresh_pages():
    pages = 64 * 2**20 // resource.getpagesize()
    # off (glibc's defaults): every 64 MiB block is mapped afresh and the kernel faults in each of its pages
    assert page_faults_of_sixteen_blocks("off") >= 16 * pages * 0.9
    # on: the freed block stays in the heap and the next ones reuse its pages. The first one or two (rarely
    # three) re-allocations still take fresh pages, as small allocations in between split the freed block
    # (measured per block: [1, 0, 0, ...] mostly, [1, 0, 1, 0, ...] at times); from then on none.
    assert page_faults_of_sixteen_blocks("on") <= 4 * pages


@pytest.mark.parametrize("enabled", [True, False])
def test_engine_applies_the_federation_setting(tiny_clients, monkeypatch, enabled):
    calls = []
    monkeypatch.setattr(simulation, "reuse_freed_memory", calls.append)
    InProcessEngine(DigitCNN(width=0.125), tiny_clients, resolve_method("fedavg"), LocalTraining(batch_size=8),
                    Federation(channels_last=False, reuse_freed_memory=enabled), normalize_batch)
    assert calls == [enabled]
