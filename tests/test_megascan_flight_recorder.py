"""PyTorch's flight-recorder dumps as the second witness of a hang, read from dumps recorded in a real NCCL hang
on four GPUs (tests/data/nccl_hang_4gpu/README.md): rank 2 stopped, its tensor-parallel peer waiting in an
all-reduce it never entered, the first stage waiting in pipeline sends. The CPU run (gloo) is in
test_megascan_detection.py's hang test."""

import pickle
from pathlib import Path

import pytest

from megascan.aggregate.flight_recorder import FlightRecorderError, find_dumps, load_dump, witness

RECORDED = Path(__file__).parent / "data" / "nccl_hang_4gpu"


def _dumps(ranks):
    return {rank: str(RECORDED / f"flight-recorder-{rank}.pkl") for rank in ranks}


def test_stopped_rank_left_no_dump_and_is_named_hung():
    result = witness(_dumps([0, 1, 3]), world_size=4)
    assert result.records_completion and result.without_dump == [2]
    assert result.hung == [2] and result.blocked == [0, 1, 3]
    tensor_group = next(group for group in result.stalled if group.kind == "collective")
    assert (tensor_group.members, tensor_group.waiting, tensor_group.behind) == ([2, 3], [3], {2: None})
    assert tensor_group.completed[3] < tensor_group.frontier
    assert sorted(rank for group in result.stalled if group.kind == "p2p" for rank in group.waiting) == [0, 1, 3]
    text = result.to_text([2])
    assert "not entered by 2 (no dump)" in text and "agrees with the traces (hung there: [2])" in text
    assert "differs from the traces" in result.to_text([3])


def test_rank_behind_in_its_group_is_hung_matched_by_sequence_number():
    """With the stopped rank's own dump (written when it was resumed before the kill): it last entered an
    earlier all-reduce of the tensor-parallel group than the one its peer waits in."""
    result = witness(_dumps([0, 1, 2, 3]), world_size=4)
    assert result.without_dump == [] and result.hung == [2] and result.blocked == [0, 1, 3]
    tensor_group = next(group for group in result.stalled if group.kind == "collective")
    assert tensor_group.behind[2] < tensor_group.frontier
    assert result.last[2].kind == "collective" and result.last[2].state == "completed"
    assert result.last[0].kind == "p2p"  # the coalesced pipeline exchange it waits in


def test_dumps_are_found_by_both_names_and_the_newer_counts(tmp_path):
    data = (RECORDED / "flight-recorder-0.pkl").read_bytes()
    (tmp_path / "flight-recorder-0.pkl").write_bytes(data)
    (tmp_path / "nccl_trace_rank_1").write_bytes(data)
    (tmp_path / "nccl_trace_rank_x").write_bytes(b"not a rank")
    elsewhere = tmp_path / "timeout"
    elsewhere.mkdir()
    (elsewhere / "dump_0").write_bytes(data)
    assert find_dumps(str(tmp_path)) == {0: str(tmp_path / "flight-recorder-0.pkl"),
                                         1: str(tmp_path / "nccl_trace_rank_1")}
    assert find_dumps(str(tmp_path), str(elsewhere / "dump_"))[0] == str(elsewhere / "dump_0")


class _Evil:
    def __reduce__(self):
        return (print, ("a crafted dump ran code",))


@pytest.mark.parametrize("content", [pickle.dumps(_Evil()), pickle.dumps([1, 2]), b"\x80\x05garbage", b"{oops"],
                         ids=["a class to call", "no dict", "a cut pickle", "bad JSON"])
def test_a_file_that_is_no_dump_is_refused_and_never_run(tmp_path, content, capsys):
    path = tmp_path / "flight-recorder-0.pkl"
    path.write_bytes(content)
    with pytest.raises(FlightRecorderError, match="not a PyTorch flight-recorder dump"):
        load_dump(str(path))
    assert "ran code" not in capsys.readouterr().out
