"""Detection on trace windows recorded on real GPUs (tests/data/*/README.md says how each was made)."""

from pathlib import Path

from megascan.aggregate import load_and_merge
from megascan.detection import detect

DATA = Path(__file__).parent / "data"


def test_loaded_data_parallel_replica_in_a_gpu_bound_job_is_named_alone():
    report = detect(load_and_merge(DATA / "dp4_loaded_replica_h100"))
    assert [(s.rank, s.kind) for s in report.suspects] == [(2, "slow_rank")], report.to_text()
    assert report.host_bound == []
    assert "its host issued" in report.suspects[0].evidence[1] and "ahead of its peers' (not late)" in (
        report.suspects[0].evidence[1])
