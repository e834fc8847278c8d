// The connection to the backend: settings, state, the welcome's declarations, and every error frame.
import { defineStore } from 'pinia';
import { computed, markRaw, ref, shallowRef } from 'vue';
import { MegascopeClient, type ConnectionState, type SocketFactory } from '../protocol/client';
import type { DataFrame } from '../protocol/dataFrame';
import type { ClientMessage, ErrorFrame, ServerMessage, Welcome } from '../protocol/messages';
import { browserStorage, initialSettings, rememberSettings } from './settings';

export interface ShownError extends ErrorFrame {
  at: Date;
}

type MessageHandler = (message: ServerMessage) => void;
type DataHandler = (frame: DataFrame) => void;

const MAX_ERRORS_KEPT = 50;

export const useConnectionStore = defineStore('connection', () => {
  const storage = browserStorage();
  const initial = initialSettings(storage, globalThis.location?.search ?? '', import.meta.env?.VITE_MEGASCOPE_URL, globalThis.location?.hostname ?? '');
  const url = ref(initial.url);
  const token = ref(initial.token);
  const state = ref<ConnectionState>('idle');
  const detail = ref('');
  const welcome = shallowRef<Welcome | null>(null);
  const errors = ref<ShownError[]>([]);
  const droppedFrames = ref(0);
  const messageHandlers: MessageHandler[] = [];
  const dataHandlers: DataHandler[] = [];
  let socketFactory: SocketFactory | undefined;

  const protocolVersion = computed(() => welcome.value?.protocol ?? null);
  const mode = computed(() => welcome.value?.mode ?? null);

  function showError(error: ErrorFrame): void {
    errors.value = [{ ...error, at: new Date() }, ...errors.value].slice(0, MAX_ERRORS_KEPT);
  }

  const client = markRaw(new MegascopeClient({
    state(next, text) {
      state.value = next;
      detail.value = text;
    },
    welcome(message) {
      welcome.value = message;
      for (const handler of messageHandlers) handler(message);
    },
    message(message) {
      if (message.type === 'error') showError(message);
      if (message.type === 'dropped') droppedFrames.value += message.frames;
      for (const handler of messageHandlers) handler(message);
    },
    data(frame) {
      for (const handler of dataHandlers) handler(frame);
    },
  }, (address) => (socketFactory ? socketFactory(address) : new WebSocket(address))));

  function connect(): void {
    rememberSettings(storage, { url: url.value, token: token.value });
    welcome.value = null;
    client.connect(url.value, token.value);
  }

  function disconnect(): void {
    client.close();
  }

  /** Send a message; when not connected, say so where errors are shown rather than dropping it silently. */
  function send(message: ClientMessage): boolean {
    const sent = client.send(message);
    if (!sent) showError({ type: 'error', code: 'not_connected', message: `cannot send "${message.type}": not connected to ${url.value}; press Connect` });
    return sent;
  }

  return {
    url, token, state, detail, welcome, errors, droppedFrames, protocolVersion, mode,
    connectAtOnce: initial.connectAtOnce,
    connect, disconnect, send, showError,
    dismissErrors: () => { errors.value = []; },
    onMessage: (handler: MessageHandler) => { messageHandlers.push(handler); },
    onData: (handler: DataHandler) => { dataHandlers.push(handler); },
    /** Tests in Node use the `ws` package's WebSocket; the page uses the browser's. */
    useSocketFactory: (factory: SocketFactory) => { socketFactory = factory; },
  };
});
