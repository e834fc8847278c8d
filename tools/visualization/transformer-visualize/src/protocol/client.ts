// One WebSocket connection to a MegaScope backend: says hello first, hands every JSON message and
// decoded data frame to its listeners, and reconnects (with growing delays) after the backend goes away.
// A normal closure by the server (1000, e.g. "training ended at iteration 40") is the end of its service:
// the state becomes 'ended' with the server's reason, and nothing retries.
import { nextFrame } from '../lib/nextFrame';
import { decodeDataFrame, FrameError, type DataFrame } from './dataFrame';
import { parseServerMessage, PROTOCOL_VERSION, type ClientMessage, type ServerMessage, type Welcome } from './messages';

export type ConnectionState = 'idle' | 'connecting' | 'connected' | 'reconnecting' | 'closed' | 'ended';

const NORMAL_CLOSURE = 1000;

export interface ClientListener {
  state(state: ConnectionState, detail: string): void;
  welcome(welcome: Welcome): void;
  message(message: ServerMessage): void;
  data(frame: DataFrame): void;
}

/** The part of the WebSocket API the client uses: the browser's, or the `ws` package's in Node tests. */
export type SocketFactory = (url: string) => WebSocket;

const RECONNECT_DELAYS_MS = [250, 500, 1000, 2000, 4000];

export class MegascopeClient {
  private socket: WebSocket | null = null;
  private attempts = 0;
  private timer: ReturnType<typeof setTimeout> | null = null;
  private wanted = false;

  constructor(
    private readonly listener: ClientListener,
    private readonly makeSocket: SocketFactory = (url) => new WebSocket(url),
  ) {}

  connect(url: string, token: string): void {
    this.close();
    this.wanted = true;
    this.open(url, token);
  }

  close(): void {
    this.wanted = false;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
    const socket = this.socket;
    this.socket = null;
    if (socket) {
      socket.onclose = null;
      socket.close();
      this.listener.state('closed', 'disconnected');
    }
  }

  /** Send one message; false when there is no open connection to send it on. */
  send(message: ClientMessage): boolean {
    if (!this.socket || this.socket.readyState !== 1) return false;
    this.socket.send(JSON.stringify(message));
    return true;
  }

  private open(url: string, token: string): void {
    this.listener.state(this.attempts === 0 ? 'connecting' : 'reconnecting', url);
    let socket: WebSocket;
    try {
      socket = this.makeSocket(url);
    } catch (error) {
      this.wanted = false;
      this.listener.state('closed', `cannot open ${url}: ${(error as Error).message}`);
      return;
    }
    socket.binaryType = 'arraybuffer';
    this.socket = socket;
    socket.onopen = () => {
      const hello: ClientMessage = token ? { type: 'hello', protocol: PROTOCOL_VERSION, token } : { type: 'hello', protocol: PROTOCOL_VERSION };
      socket.send(JSON.stringify(hello));
    };
    socket.onmessage = (event: MessageEvent) => this.enqueue(event.data);
    socket.onclose = (event: CloseEvent) => {
      if (this.socket !== socket) return;
      this.socket = null;
      if (!this.wanted) return;
      if (event.code === NORMAL_CLOSURE) {
        this.wanted = false;
        this.listener.state('ended', event.reason || 'the server closed the connection');
        return;
      }
      const delay = RECONNECT_DELAYS_MS[Math.min(this.attempts, RECONNECT_DELAYS_MS.length - 1)];
      this.attempts += 1;
      this.listener.state('reconnecting', `connection closed (${event.code}${event.reason ? ': ' + event.reason : ''}); retrying in ${delay} ms`);
      this.timer = setTimeout(() => {
        this.timer = null;
        if (this.wanted) this.open(url, token);
      }, delay);
    };
  }

  // Messages come one per task, thousands a second while a generation streams; handing them over in
  // batches (once per animation frame) lets the page render once per batch instead of once per message.
  private queue: unknown[] = [];

  private enqueue(data: unknown): void {
    this.queue.push(data);
    if (this.queue.length > 1) return;
    nextFrame(() => {
      const batch = this.queue;
      this.queue = [];
      for (const item of batch) this.receive(item);
    });
  }

  private receive(data: unknown): void {
    if (typeof data === 'string') {
      const message = parseServerMessage(data);
      if (message.type === 'welcome') {
        this.attempts = 0;
        this.listener.state('connected', `protocol ${message.protocol}, ${message.mode}`);
        this.listener.welcome(message);
      } else {
        this.listener.message(message);
      }
      return;
    }
    try {
      this.listener.data(decodeDataFrame(toArrayBuffer(data)));
    } catch (error) {
      const message = error instanceof FrameError ? error.message : String(error);
      this.listener.message({ type: 'error', code: 'bad_frame', message });
    }
  }
}

function toArrayBuffer(data: unknown): ArrayBuffer {
  if (data instanceof ArrayBuffer) return data;
  if (ArrayBuffer.isView(data)) {  // Node's `ws` hands over a Buffer
    const copy = new Uint8Array(data.byteLength);
    copy.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
    return copy.buffer;
  }
  throw new FrameError('binary frame of an unknown kind');
}
