// Where the page connects: the ?url= query parameter, else what the user last used (local storage),
// else VITE_MEGASCOPE_URL at build time, else the protocol's default WebSocket port on the page's host.
// An address given in ?url= is connected to at once (a link that names its backend needs no click).
export const DEFAULT_WS_PORT = 5001;
const URL_KEY = 'megascope.url';
const TOKEN_KEY = 'megascope.token';

export interface ConnectionSettings {
  url: string;
  token: string;
}

export interface InitialSettings extends ConnectionSettings {
  connectAtOnce: boolean;  // the address came from ?url=
}

/** The small part of the Storage API used here (window.localStorage in the page, a Map in tests). */
export interface KeyValueStore {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
}

export function initialSettings(storage: KeyValueStore | null, query: string, envUrl: string | undefined, pageHost: string): InitialSettings {
  const params = new URLSearchParams(query);
  const queryUrl = params.get('url');
  const url = queryUrl || storage?.getItem(URL_KEY) || envUrl || `ws://${pageHost || '127.0.0.1'}:${DEFAULT_WS_PORT}/`;
  const token = params.get('token') ?? storage?.getItem(TOKEN_KEY) ?? '';
  return { url, token, connectAtOnce: Boolean(queryUrl) };
}

export function rememberSettings(storage: KeyValueStore | null, settings: ConnectionSettings): void {
  storage?.setItem(URL_KEY, settings.url);
  storage?.setItem(TOKEN_KEY, settings.token);
}

/** The page's storage, or null where local storage cannot be used (private modes, tests). */
export function browserStorage(): KeyValueStore | null {
  try {
    return typeof localStorage === 'undefined' ? null : localStorage;
  } catch {
    return null;
  }
}
