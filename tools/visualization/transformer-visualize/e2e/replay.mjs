// A WebSocket server between the page and a real backend that records a generation and replays it.
// Everything the page sends goes to the backend unchanged; what the backend answers goes back unchanged,
// except a generation's stream (from the page's `generate` to its `generation_done` or error): that is held
// until it is complete, then sent on `replay()` as fast as the page's socket takes it. A CPU backend produces
// a large model's frames slowly, so the page would always have time to spare between them; replayed, they
// arrive as from a GPU that streams faster than the page reads, the case that must still render in time.
import { WebSocket, WebSocketServer } from 'ws';

/** Start on a loopback port; `url` is what the page connects to, `backendUrl` the real server. */
export function startReplay(backendUrl) {
  let held = [];          // the recorded generation: [{ data, isBinary }], in the order the backend sent it
  let generationId = null;
  let pageSocket = null;
  let complete;
  const recorded = new Promise((resolve) => { complete = resolve; });

  const server = new WebSocketServer({ host: '127.0.0.1', port: 0 });
  server.on('connection', (socket) => {
    pageSocket = socket;
    const backend = new WebSocket(backendUrl, { maxPayload: 0 });
    const toBackend = [];  // what the page said before the backend's socket opened
    backend.on('open', () => toBackend.splice(0).forEach((m) => backend.send(m)));
    socket.on('message', (data) => {
      const message = JSON.parse(String(data));
      if (message.type === 'generate') {
        generationId = message.id;
        held = [];
      }
      if (backend.readyState === WebSocket.OPEN) backend.send(String(data));
      else toBackend.push(String(data));
    });
    backend.on('message', (data, isBinary) => {
      if (generationId === null) {
        socket.send(data, { binary: isBinary });
        return;
      }
      held.push({ data, isBinary });
      const message = isBinary ? null : JSON.parse(String(data));
      if (message && (message.type === 'generation_done' || message.type === 'error') && message.id === generationId) {
        generationId = null;
        complete(summary(held));
      }
    });
    socket.on('close', () => backend.close());
    backend.on('close', () => socket.close());
  });

  return new Promise((resolve) => server.on('listening', () => resolve({
    url: `ws://127.0.0.1:${server.address().port}/`,
    /** Resolves once the backend has answered the whole generation: its message and frame counts. */
    recorded,
    /** Send the recorded generation to the page; resolves with performance.now() when its last message has
     *  been written to the page's socket. */
    replay() {
      return new Promise((done) => held.forEach(({ data, isBinary }, i) => pageSocket.send(data, { binary: isBinary },
        i === held.length - 1 ? () => done(performance.now()) : undefined)));
    },
    close: () => new Promise((closed) => {
      for (const client of server.clients) client.terminate();
      server.close(() => closed());
    }),
  })));
}

function summary(held) {
  const frames = held.filter((m) => m.isBinary);
  const messages = held.filter((m) => !m.isBinary).map((m) => JSON.parse(String(m.data)));
  return { frames: frames.length, bytes: frames.reduce((n, m) => n + m.data.length, 0), messages };
}
