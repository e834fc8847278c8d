"""megascope/ws_server.py over real sockets: hello/token/Origin, error frames that keep the connection,
size and rate limits, and the bounded send queue that drops the oldest data frames of a slow client."""

import asyncio
import json
import threading

import numpy as np
import pytest
import websockets
from websockets.asyncio.client import connect

from megascope.errors import ProtocolError
from megascope.wire import decode_data_frame, encode_data_frame
from megascope.ws_server import WebSocketServer
from megatron.inference.limits import Limits
from megatron.training.errors import UserError


class FloodSession:
    """A session whose `generate` pushes `frames` large data frames at once from another thread (the way
    the model loop does), then a generation_done; `ready` is set once everything is queued."""
    mode = "inference"

    def __init__(self, frames=0):
        self.frames = frames
        self.ready = threading.Event()
        self.disconnected = []

    def welcome_info(self):
        return {"model": {"num_layers": 1}, "hooks": [], "reductions": [], "noise": []}

    def on_welcome(self, client):
        pass

    def on_message(self, client, message):
        if message["type"] != "generate":
            raise ProtocolError("bad_field", "this test session only generates", "type")
        threading.Thread(target=self._flood, args=(client, message["id"])).start()

    def _flood(self, client, id):
        start = client.dropped_total
        values = np.zeros((256, 256), dtype=np.float32)  # 256 KiB per frame as float32
        for step in range(self.frames):
            client.send_data(encode_data_frame({"id": id, "step": step}, values, dtype="float32"))
        client.send({"type": "generation_done", "id": id, "dropped_frames": client.dropped_total - start})
        self.ready.set()

    def on_disconnect(self, client):
        self.disconnected.append(client.number)


def serve(session, **kwargs):
    return WebSocketServer(session, port=0, **kwargs).start()


async def hello(ws, **fields):
    await ws.send(json.dumps({"type": "hello", "protocol": 1, **fields}))
    return json.loads(await ws.recv())


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


def test_errors_keep_the_connection_usable():
    server = serve(FloodSession())

    async def client():
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            await ws.send('{"type": "ping"}')
            assert json.loads(await ws.recv())["code"] == "unauthorized"
            welcome = await hello(ws, id=7)
            assert welcome["type"] == "welcome" and welcome["id"] == 7 and welcome["limits"]["max_prompts"] == 16
            # (frame, code, field, id): every error frame echoes a valid id the frame carried, also when the
            # frame itself failed validation; an invalid id is not echoed
            cases = [("{oops", "bad_json", None, None),
                     ('{"type": "teleport", "id": "t"}', "unknown_type", "type", "t"),
                     ('{"type": "generate", "id": 3, "prompts": "hi"}', "bad_field", "prompts", 3),
                     ('{"type": "generate", "id": "g", "prompts": ["hi"], "top_k": 2, "top_p": 0.5}', "bad_field",
                      "top_p", "g"),
                     ('{"type": "train", "id": 4, "action": "pause"}', "unknown_type", "type", 4),
                     ('{"type": "set_capture", "id": "s", "capture": {}}', "bad_field", "type", "s"),
                     ('{"type": "ping", "id": [1]}', "bad_field", "id", None),
                     ("[" * 50_000 + "]" * 50_000, "bad_json", None, None)]  # nested past Python's recursion limit
            for text, code, field, id in cases:
                await ws.send(text)
                error = json.loads(await ws.recv())
                assert (error["type"], error["code"], error.get("field"), error.get("id")) == \
                    ("error", code, field, id), text
            await ws.send(b"\x00\x01")
            assert json.loads(await ws.recv())["code"] == "bad_json"
            await ws.send('{"type": "ping", "id": "p"}')
            assert json.loads(await ws.recv()) == {"type": "pong", "id": "p"}

    run(client())
    server.stop()


def test_oversized_closes_only_that_connection_and_wrong_version():
    server = serve(FloodSession(), limits=Limits(max_message_bytes=1000))

    async def client():
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "ping", "id": "x" * 2000}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1009
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            error = await hello(ws, protocol=4)
            assert (error["code"], error["field"]) == ("bad_field", "protocol")
            assert (await hello(ws, protocol=3))["protocol"] == 3
        for older in (1, 2):  # an earlier client's hello is taken: what it sends stays valid
            async with connect(f"ws://127.0.0.1:{server.port}") as ws:
                assert (await hello(ws, protocol=older))["protocol"] == 3

    run(client())
    server.stop()


def test_rate_limit():
    server = serve(FloodSession(), limits=Limits(max_messages_per_second=5))

    async def client():
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            await hello(ws)
            for number in range(40):
                await ws.send(json.dumps({"type": "ping", "id": number}))
            replies = [json.loads(await ws.recv()) for _ in range(40)]
            assert {"type": "pong", "id": 0} in replies
            refused = [reply for reply in replies if reply.get("code") == "rate_limited"]
            assert refused and sorted(reply["id"] for reply in replies) == list(range(40))  # each names its ping

    run(client())
    server.stop()


def test_token_for_a_non_local_host():
    server = serve(FloodSession(), host="127.0.0.2", token="s3cret")

    async def client():
        for token in (None, "guess"):
            async with connect(f"ws://127.0.0.2:{server.port}") as ws:
                error = await hello(ws, token=token)
                assert (error["code"], error["field"]) == ("unauthorized", "token")
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await ws.recv()
                assert closed.value.rcvd.code == 1008
        async with connect(f"ws://127.0.0.2:{server.port}") as ws:
            assert (await hello(ws, token="s3cret"))["type"] == "welcome"

    run(client())
    server.stop()


def test_generated_token_is_printed(capsys):
    server = serve(FloodSession(), host="127.0.0.2")
    assert server.token and server.token in capsys.readouterr().out
    server.stop()


def test_a_port_in_use_is_one_line_naming_the_flags_that_chose_it():
    server = serve(FloodSession())
    with pytest.raises(UserError, match=r"^--training-ws-host/--training-ws-port: cannot listen on 127\.0\.0\.1:"
                       + str(server.port)):
        WebSocketServer(FloodSession(), port=server.port, flags="--training-ws-host/--training-ws-port").start()
    server.stop()


def test_origin_is_checked():
    server = serve(FloodSession(), origins=("https://scope.example",))

    async def client():
        for origin in ("http://localhost:5173", "https://scope.example", "http://127.0.0.1"):
            async with connect(f"ws://127.0.0.1:{server.port}", origin=origin) as ws:
                assert (await hello(ws))["type"] == "welcome"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with connect(f"ws://127.0.0.1:{server.port}", origin="http://evil.example"):
                pass
        assert refused.value.response.status_code == 403

    run(client())
    server.stop()


def test_slow_client_gets_a_drop_count_and_the_model_never_waits():
    frames = 300  # 75 MiB: more than any socket buffer holds
    session = FloodSession(frames)
    server = serve(session, limits=Limits(send_queue_frames=8))

    async def client():
        async with connect(f"ws://127.0.0.1:{server.port}", max_size=None, max_queue=1) as ws:
            await hello(ws)
            await ws.send('{"type": "generate", "id": "g", "prompts": ["x"]}')
            # The client reads nothing until the session has queued every frame: pushing never waited.
            await asyncio.get_running_loop().run_in_executor(None, session.ready.wait)
            received, reported = [], 0
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    received.append(decode_data_frame(message)[0]["step"])
                    continue
                message = json.loads(message)
                if message["type"] == "dropped":
                    reported += message["frames"]
                elif message["type"] == "generation_done":
                    break
            assert message["dropped_frames"] > 0 and received == sorted(received)
            assert len(received) + message["dropped_frames"] == frames
            assert received[-1] == frames - 1  # the newest frames are kept, the oldest dropped
            return reported, message["dropped_frames"]

    reported, dropped = run(client())
    assert reported == dropped
    server.stop()
    assert len(session.disconnected) == 1


def test_a_stop_with_a_reason_sends_what_is_queued_then_closes_normally_with_it():
    """A service that has ended (training) says so: close code 1000 and the reason, after the last messages;
    a plain stop is 1001 (going away: the page retries)."""
    async def client(reason):
        server = serve(FloodSession())
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            assert (await hello(ws))["type"] == "welcome"
            server.broadcast({"type": "training_state", "state": "stopping", "iteration": 7})
            await asyncio.to_thread(server.stop, reason)
            last = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        return last, closed.value.rcvd
    last, goodbye = run(client("training ended at iteration 7"))
    assert last["state"] == "stopping" and (goodbye.code, goodbye.reason) == (1000, "training ended at iteration 7")
    assert run(client(None))[1].code == 1001
