"""Start tools/run_text_generation_server.py under torchrun for a test and talk to it (REST and WebSocket)."""

import asyncio
import json
import os
import re
import subprocess
import threading
import urllib.error
import urllib.request

import psutil
from websockets.asyncio.client import connect

from helpers.launch import REPO, child_env, kill_process_tree, torchrun_command

TINY_SERVER = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
               "--seq-length", "64", "--max-position-embeddings", "64", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--use-cpu-initialization", "--device", "cpu",
               # untied, wider initialization: a random tiny model that does not just repeat its last token
               "--untie-embeddings-and-output-weights", "--init-method-std", "0.2",
               "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(REPO / "datasets/gpt/vocab.json"),
               "--merge-file", str(REPO / "datasets/gpt/merges.txt")]


class GenerationServer:
    """A running server: ``rest`` (http://...), ``ws`` (ws://...) and ``rank0`` (rank 0's pid) once it listens;
    ``stop()`` kills it, ``interrupt(signal)`` stops it as a user or a scheduler would."""

    def __init__(self, nproc, args, timeout=300, command=None, env=None, cwd=REPO):
        """torchrun of the server with ``args`` on ``nproc`` ranks, or ``command`` (e.g. an example script) run
        in ``cwd``."""
        command = command or torchrun_command(nproc, "tools/run_text_generation_server.py",
                                              [*args, "--port", "0", "--enable-ws-server", "--ws-port", "0"])
        # A process group of its own, as a command started in a terminal: Ctrl-C signals that group.
        self.job = subprocess.Popen(command, cwd=cwd, env=child_env(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = []
        self._listening = threading.Event()
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # Its last start-up line, not its exit: the output can end before the launcher is reaped.
        if not self._listening.wait(timeout) or not any(line.startswith("server pid ") for line in self.lines):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines[-40:]))
        output = "".join(self.lines)
        self.rest = re.search(r"REST API on (http://\S+)/api", output).group(1)
        self.ws = re.search(r"MegaScope WebSocket on (ws://\S+)", output).group(1)
        self.rank0 = int(re.search(r"server pid (\d+)", output).group(1))

    def _read(self):
        for line in self.job.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()
            if line.startswith("server pid "):  # rank 0's last line once it serves
                self._listening.set()
        self._listening.set()  # exited

    def logged(self, text, timeout=60, since=0):
        """Whether a line holding ``text`` is in the output (from its line ``since`` on), or comes within ``timeout``
        seconds."""
        with self._new_line:
            return self._new_line.wait_for(lambda: any(text in line for line in self.lines[since:]), timeout)

    def interrupt(self, signum, pid=None, timeout=120):
        """Send ``signum`` to ``pid`` (default: the launched process's group, as Ctrl-C in a terminal does) and
        wait until the job and all its processes have ended: (exit code, the output since the signal, the
        processes still alive)."""
        processes = psutil.Process(self.job.pid).children(recursive=True)
        seen = len(self.lines)
        if pid is None:
            os.killpg(self.job.pid, signum)
        else:
            os.kill(pid, signum)
        try:
            self.job.wait(timeout=timeout)
            alive = psutil.wait_procs(processes, timeout=timeout)[1]
            self._reader.join(timeout=timeout)
        finally:
            self.stop()
        return self.job.returncode, "".join(self.lines[seen:]), alive

    def stop(self):
        if self.job.poll() is None:
            kill_process_tree(self.job.pid)
        self.job.wait()

    def put(self, body):
        """(status, answer JSON) of PUT /api."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.rest + "/api", data=data, method="PUT",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())


def websocket(server, **kwargs):
    return connect(server.ws, max_size=None, **kwargs)


async def send(ws, message):
    await ws.send(json.dumps(message))


async def receive(ws):
    """The next JSON message (binary data frames are returned as bytes)."""
    message = await ws.recv()
    return message if isinstance(message, bytes) else json.loads(message)


async def generation(ws, request):
    """Send a generate and collect everything until generation_done: (messages, data frames)."""
    await send(ws, request)
    messages, frames = [], []
    while True:
        message = await receive(ws)
        if isinstance(message, bytes):
            frames.append(message)
            continue
        messages.append(message)
        if message["type"] in ("generation_done", "error"):
            return messages, frames


def run(coroutine, timeout=300):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))

