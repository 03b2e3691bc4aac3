"""pytest --shard K/N (tests/conftest.py): the GPU suite split over device calls. The N shards of a
collection are disjoint and together hold every test; a bad K/N is one usage line."""
import subprocess
import sys

from tests.conftest import ROOT


def _collected(*args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/test_gelu.py", "-m", "gpu or not gpu", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    return r, [line for line in r.stdout.splitlines() if "::" in line]


def test_shards_partition_the_collection():
    _, every = _collected()
    assert len(every) > 10
    shards = [_collected("--shard", f"{k}/3")[1] for k in range(3)]
    assert sorted(sum(shards, [])) == sorted(every)
    assert all(len(s) >= len(every) // 3 for s in shards)


def test_a_bad_shard_is_one_usage_line():
    for bad in ("2/2", "x", "1/0"):
        r, _ = _collected("--shard", bad)
        assert r.returncode != 0 and "--shard" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
