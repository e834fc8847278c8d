"""MegaScope training mode: pretrain_gpt.py --training-ws-port under torchrun/gloo, driven by a real
`websockets` client. pause / step n / resume move the iteration counter exactly as asked, stop saves a
checkpoint and exits 0, the chosen sample's capture and perturbations arrive between iterations, bad
requests get error frames, per-layer norms are equal at TP2xPP2 and TP1 with one server, and a run with
the port and no client trains to the end."""

import argparse
import json
import subprocess
import threading

import pytest
import websockets
from helpers.launch import REPO, child_env, kill_process_tree, torchrun, torchrun_command
from websockets.sync.client import connect

from megascope import PLUGIN
from megascope.wire import decode_data_frame
from megatron.training.errors import ArgumentError
from megatron.training.ports import free_port

TRAIN = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--use-cpu-initialization", "--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--make-vocab-size-divisible-by", "64", "--mock-data", "--log-interval", "1", "--eval-iters", "0"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TIMEOUT = 300


class TrainingJob:
    """A training run in the background and one WebSocket client of its MegaScope server."""

    def __init__(self, nproc, flags):
        self.port = free_port()
        command = torchrun_command(nproc, "pretrain_gpt.py", TRAIN + flags + ["--training-ws-port", self.port])
        self.process = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.server_up = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.socket = None

    def _read(self):
        """Keep the pipe drained; note when the server says it listens (or the job ends)."""
        for line in self.process.stdout:
            self.lines.append(line)
            if "MegaScope training server on" in line:
                self.server_up.set()
        self.server_up.set()

    def connect(self):
        assert self.server_up.wait(TIMEOUT) and self.process.poll() is None, "".join(self.lines)[-3000:]
        self.socket = connect(f"ws://127.0.0.1:{self.port}", open_timeout=30)
        self.send({"type": "hello", "protocol": 1})
        welcome = self.receive()
        assert welcome["type"] == "welcome" and welcome["mode"] == "training", welcome
        # NullTokenizer: --vocab-size ids plus its end-of-document token, not the 128 padded rows
        assert welcome["model"]["vocab_size"] == 101 and welcome["model"]["num_layers"] == 4, welcome
        return welcome

    def send(self, message):
        self.socket.send(json.dumps(message))

    def receive(self):
        """The next JSON message (data frames are returned as bytes)."""
        frame = self.socket.recv(timeout=TIMEOUT)
        return frame if isinstance(frame, bytes) else json.loads(frame)

    def until(self, predicate):
        """Every message up to and including the first one for which ``predicate`` holds."""
        seen = []
        while True:
            message = self.receive()
            seen.append(message)
            if not isinstance(message, bytes) and predicate(message):
                return seen

    def goodbye(self):
        """The messages still to come and the server's close frame (the run has ended)."""
        rest = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                rest.append(self.receive())
        return rest, closed.value.rcvd

    def finish(self):
        try:
            self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_process_tree(self.process.pid)
            raise
        self.reader.join(timeout=TIMEOUT)
        return self.process.returncode, "".join(self.lines)

    def close(self):
        if self.socket is not None:
            self.socket.close()
        if self.process.poll() is None:
            kill_process_tree(self.process.pid)
            self.process.wait()


def _iterations(messages):
    return [m["iteration"] for m in messages if isinstance(m, dict) and m["type"] == "iteration"]


def _paused(message):
    return message["type"] == "training_state" and message["state"] == "paused"


def test_pause_step_resume_stop_capture_and_perturb_between_iterations(tmp_path):
    job = TrainingJob(1, ["--train-iters", "200", "--training-ws-wait", "--save", str(tmp_path / "ckpt")])
    try:
        job.connect()
        # told at once that the run waits (the page enables its controls on it)
        assert job.receive() == {"type": "training_state", "state": "paused", "iteration": 0}
        job.send({"type": "train", "action": "step", "n": 2})
        assert _iterations(job.until(_paused)) == [1, 2]
        job.send({"type": "set_capture", "capture": {"hooks": ["resid_post"], "reduction": "bins(4)", "sample": 3}})
        assert job.until(lambda m: m["type"] == "capture_set")[-1]["capture"]["sample"] == 3
        job.send({"type": "set_capture", "capture": {"hooks": ["resid_post"], "reduction": "bins(zero)"}})
        error = job.until(lambda m: m["type"] == "error")[-1]
        assert (error["code"], error["field"]) == ("bad_reduction", "capture.reduction")
        job.send({"type": "set_capture", "capture": {"hooks": [], "attribution": True}})  # no token is chosen here
        error = job.until(lambda m: m["type"] == "error")[-1]
        assert (error["code"], error["field"]) == ("bad_field", "capture.attribution")
        noise = {"id": "n", "kind": "storage", "target": "attn.qkv", "noise": "gaussian", "scale": 0.01, "seed": 1}
        job.send({"type": "perturb", "perturbations": [noise]})
        assert job.until(lambda m: m["type"] == "perturbations")[-1]["active"][0]["target"] == "attn.qkv"
        job.send({"type": "train", "action": "step", "n": 1})
        third = job.until(_paused)
        assert _iterations(third) == [3] and third[-1]["iteration"] == 3
        frames = [m for m in third if isinstance(m, bytes)]
        headers = [json.loads(frame[8:8 + int.from_bytes(frame[4:8], "little")]) for frame in frames]
        assert sorted(h["hook"] for h in headers) == [f"blocks.{layer}.resid_post" for layer in range(4)]
        assert all(h["step"] == 3 and h["prompt_index"] == 3 and h["shape"] == [32, 4] for h in headers), \
            json.dumps(headers[0])
        job.send({"type": "train", "action": "resume", "id": "r"})
        running = job.until(lambda m: m["type"] == "iteration")
        assert [(m["id"], m["iteration"]) for m in running if isinstance(m, dict) and m["type"] == "training_state"] \
            == [("r", 3)]  # resumed after iteration 3
        # pause mid-run: the reply names the last iteration completed, the one a following step 1 goes on from
        job.send({"type": "train", "action": "pause", "id": "p"})
        running += job.until(lambda m: m["type"] == "training_state" and m.get("id") == "p")
        paused = running[-1]
        assert paused["state"] == "paused" and paused["iteration"] == _iterations(running)[-1]
        job.send({"type": "train", "action": "step", "n": 1})
        after_pause = job.until(_paused)
        assert _iterations(after_pause) == [paused["iteration"] + 1] == [after_pause[-1]["iteration"]]
        job.send({"type": "train", "action": "stop"})
        rest = after_pause + job.until(lambda m: m["type"] == "training_state" and m["state"] == "stopping")
        _, goodbye = job.goodbye()
        code, output = job.finish()
        assert code == 0, output[-3000:]
        stopped_at = int((tmp_path / "ckpt/latest_checkpointed_iteration.txt").read_text())
        # a normal closure that says why: the page shows the end instead of a lost connection it retries
        assert (goodbye.code, goodbye.reason) == (1000, f"training ended at iteration {stopped_at}")
        assert _iterations(running + rest) == list(range(4, paused["iteration"] + 2))
        assert stopped_at == paused["iteration"] + 1 and f"saved checkpoint at iteration {stopped_at}" in output
    finally:
        job.close()


def _streamed_run(nproc, flags):
    job = TrainingJob(nproc, ["--train-iters", "3", "--training-ws-wait", *flags])
    try:
        job.connect()
        job.send({"type": "set_capture", "capture": {"hooks": ["attn.pattern", "mlp.out", "logits"],
                                                     "reduction": "norm", "sample": 3}})
        job.send({"type": "train", "action": "resume"})
        messages = job.until(lambda m: m["type"] == "iteration" and m["iteration"] == 3)
        rest, goodbye = job.goodbye()  # the end of --train-iters closes like a stop request
        assert rest[-1] == {"type": "training_state", "state": "stopping", "iteration": 3}
        assert (goodbye.code, goodbye.reason) == (1000, "training ended at iteration 3")
        code, output = job.finish()
        assert code == 0, output[-3000:]
        frames = [decode_data_frame(m) for m in messages if isinstance(m, bytes)]
        captured = {(header["step"], header["hook"]): values for header, values in frames}
        return [m for m in messages if isinstance(m, dict) and m["type"] == "iteration"], captured, output
    finally:
        job.close()


def test_per_layer_norms_and_the_samples_capture_are_equal_at_tp2_pp2_and_one_rank_with_one_server():
    single, single_captured, _ = _streamed_run(1, [])
    parallel, captured, output = _streamed_run(4, TP2_PP2)
    assert output.count("MegaScope training server on") == 1
    # the chosen sample's internals, every iteration: 4 layers x (pattern, mlp.out) + logits
    assert captured.keys() == single_captured.keys() and len(captured) == 3 * 9
    for key, values in single_captured.items():
        assert captured[key] == pytest.approx(values, rel=2e-3, abs=1e-3), key
    assert [m["iteration"] for m in parallel] == [1, 2, 3]
    for got, want in zip(parallel, single):
        for key in ("lm_loss", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-3), key
        for key in ("activation_norms", "grad_norms"):
            assert len(got[key]) == 4 and got[key] == pytest.approx(want[key], rel=1e-3), key


def test_with_the_port_and_no_client_training_runs_to_the_end():
    result = torchrun(1, "pretrain_gpt.py", TRAIN + ["--train-iters", "3", "--training-ws-port", free_port()],
                      timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "iteration        3/       3" in result.stdout


def test_flag_off_installs_nothing_and_a_port_outside_the_tcp_range_is_refused():
    assert not PLUGIN.is_enabled(argparse.Namespace(training_ws_port=None))
    with pytest.raises(ArgumentError, match="--training-ws-port 70000: a TCP port is 1 .. 65535"):
        PLUGIN.validate_args(argparse.Namespace(training_ws_port=70000))
