// The stores against a real WebSocket server on a loopback port (the `ws` package), scripted to answer as
// docs/megascope_protocol.md says; the page's own code runs unchanged except for the socket class (Node has none).
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { createPinia, setActivePinia, type Pinia } from 'pinia';
import { WebSocket as NodeWebSocket, WebSocketServer } from 'ws';
import type { AddressInfo } from 'node:net';
import { useCapturesStore } from '../src/stores/captures';
import { useConnectionStore } from '../src/stores/connection';
import { useGenerationStore } from '../src/stores/generation';
import { removedByLayerNorm, targetsFor, usePerturbationsStore } from '../src/stores/perturbations';
import { useTrainingStore } from '../src/stores/training';
import { wireStores } from '../src/stores/wiring';
import type { IterationMessage } from '../src/protocol/messages';
import { decodeDataFrame } from '../src/protocol/dataFrame';
import { buildFrame } from './frames';

const WELCOME = {
  type: 'welcome', protocol: 3, mode: 'inference',
  model: { num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_query_groups: 2, vocab_size: 100, tp: 1, pp: 1, dp: 1 },
  hooks: ['embed', 'blocks.{l}.attn.pattern'], reductions: ['none', 'norm'], noise: ['gaussian'], limits: {},
  perturbation_targets: { storage: ['attn.qkv', 'ln2'], calculation: ['embed', 'final_norm'], system: ['resid_post'] },
};

type Script = (message: Record<string, unknown>, reply: (m: object | ArrayBuffer) => void) => void;

function startServer(port: number, script: Script, received: Record<string, unknown>[]): Promise<WebSocketServer> {
  return new Promise((resolve) => {
    const server: WebSocketServer = new WebSocketServer({ host: '127.0.0.1', port }, () => resolve(server));
    server.on('connection', (socket: NodeWebSocket) => {
      socket.on('message', (data: Buffer) => {
        const message = JSON.parse(String(data)) as Record<string, unknown>;
        received.push(message);
        script(message, (m) => socket.send(m instanceof ArrayBuffer ? Buffer.from(m) : JSON.stringify(m)));
      });
    });
  });
}

function stopServer(server: WebSocketServer): Promise<void> {
  for (const client of server.clients) client.terminate();
  return new Promise((resolve) => server.close(() => resolve()));
}

async function until(condition: () => boolean, what: string): Promise<void> {
  for (let i = 0; i < 500 && !condition(); i++) await new Promise((r) => setTimeout(r, 10));
  if (!condition()) throw new Error(`timed out waiting for ${what}`);
}

const welcoming: Script = (message, reply) => {
  if (message.type === 'hello') reply(WELCOME);
};

let pinia: Pinia;
let server: WebSocketServer | null = null;
let received: Record<string, unknown>[];

async function connected(script: Script): Promise<ReturnType<typeof useConnectionStore>> {
  received = [];
  server = await startServer(0, script, received);
  const connection = useConnectionStore(pinia);
  connection.useSocketFactory((url) => new NodeWebSocket(url) as unknown as WebSocket);
  connection.url = `ws://127.0.0.1:${(server.address() as AddressInfo).port}/`;
  connection.token = 'secret';
  connection.connect();
  await until(() => connection.state === 'connected', 'the welcome');
  return connection;
}

beforeEach(() => {
  pinia = createPinia();
  setActivePinia(pinia);
  wireStores(pinia);
});

afterEach(async () => {
  useConnectionStore(pinia).disconnect();
  if (server) await stopServer(server);
  server = null;
});

describe('connection store', () => {
  it('says hello first with the token, then shows the protocol version, the mode and every error frame', async () => {
    const connection = await connected((message, reply) => {
      welcoming(message, reply);
      if (message.type === 'ping') reply({ type: 'error', code: 'rate_limited', message: 'more than 50 messages in a second; slow down.', id: 'x' });
    });
    expect(received[0]).toEqual({ type: 'hello', protocol: 3, token: 'secret' });
    expect(connection.protocolVersion).toBe(3);
    expect(connection.mode).toBe('inference');
    expect(connection.send({ type: 'ping' })).toBe(true);
    await until(() => connection.errors.length === 1, 'the error frame');
    expect(connection.errors[0]).toMatchObject({ code: 'rate_limited', message: 'more than 50 messages in a second; slow down.', id: 'x' });
  });

  it('reconnects after the backend restarts on the same port, and says hello again', async () => {
    const connection = await connected(welcoming);
    const port = (server!.address() as AddressInfo).port;
    await stopServer(server!);
    await until(() => connection.state === 'reconnecting', 'the reconnecting state');
    server = await startServer(port, welcoming, received);
    await until(() => connection.state === 'connected', 'the second welcome');
    expect(received.filter((m) => m.type === 'hello')).toHaveLength(2);
  });

  it('shows a normal closure by the server (a training run that ended) as ended with its reason, and does not retry', async () => {
    const connection = await connected(welcoming);
    for (const client of server!.clients) client.close(1000, 'training ended at iteration 3');
    await until(() => connection.state !== 'connected', 'the closure');
    expect([connection.state, connection.detail]).toEqual(['ended', 'training ended at iteration 3']);
  });

  it('refuses to send while disconnected and says so', () => {
    const connection = useConnectionStore(pinia);
    expect(connection.send({ type: 'ping' })).toBe(false);
    expect(connection.errors[0].code).toBe('not_connected');
  });
});

describe('generation, captures and perturbations stores', () => {
  it('follows a generation: prompt tokens, streamed tokens, logit lens, data frames, PCA, done', async () => {
    const connection = await connected((message, reply) => {
      welcoming(message, reply);
      if (message.type !== 'generate') return;
      const id = message.id as string;
      reply({ type: 'generation_started', id, random_seed: 7, prompt_tokens: [[{ id: 1, text: 'a' }], [{ id: 2, text: 'b' }, { id: 3, text: 'c' }]] });
      reply(buildFrame({ id, step: 0, hook: 'blocks.0.attn.pattern', layer: 0, prompt_index: 1, tokens: [0, 2], shape: [2, 1, 2], dims: ['token', 'head', 'key'], reduction: 'none' }, [1, 0, 0.5, 0.5]));
      reply({ type: 'token', id, step: 1, tokens: [{ prompt_index: 0, token_id: 4, text: 'd', prob: 0.5, logprob: -0.7, topk: [{ token_id: 4, text: 'd', prob: 0.5 }] }, { prompt_index: 1, token_id: 5, text: 'e', prob: 0.25, logprob: -1.4, topk: [] }] });
      reply({ type: 'logit_lens', id, step: 1, prompt_index: 0, layers: [{ layer: 0, topk: [{ token_id: 4, text: 'd', prob: 0.3 }] }] });
      reply({ type: 'pca', id, hook: 'resid_post', layer: 0, points: [{ prompt_index: 0, token_index: 0, text: 'a', x: 3, y: 4 }], explained_variance: [0.8, 0.1] });
      reply({ type: 'pca', id, hook: 'resid_post', layer: 1, points: [{ prompt_index: 0, token_index: 0, text: 'a', x: 1, y: 2 }], explained_variance: [0.6, 0.3] });
      reply({ type: 'generation_done', id, texts: ['d', 'e'], tokens: [[4], [5]], finish_reason: ['length', 'length'], dropped_frames: 0 });
    });
    const generation = useGenerationStore(pinia);
    const captures = useCapturesStore(pinia);
    generation.params.prompts = ['a', 'b c'];
    const done = await generation.generate(connection.send, null, []);
    expect(done.tokens).toEqual([[4], [5]]);
    const request = received.find((m) => m.type === 'generate')!;
    expect(request).toMatchObject({ prompts: ['a', 'b c'], tokens_to_generate: 8, random_seed: 1234, capture: null, chat: false });
    const run = generation.current!;
    expect(run.seed).toBe(7);
    expect(run.generated.map((tokens) => tokens.map((t) => t.token_id))).toEqual([[4], [5]]);
    expect(generation.lensFor(0, 1)?.[0].topk[0].text).toBe('d');
    // every layer's PCA is kept: choosing another layer shows it without generating again
    expect(generation.pcas.map((m) => m.layer)).toEqual([0, 1]);
    expect(generation.pca?.explained_variance).toEqual([0.8, 0.1]);
    generation.pcaLayer = 1;
    expect(generation.pca?.explained_variance).toEqual([0.6, 0.3]);
    expect(generation.history[0].id).toBe(run.id);
    expect(captures.series.get('1|blocks.0.attn.pattern')?.rows.size).toBe(2);
  });

  it('offers exactly the perturbation targets the welcome declares', () => {
    expect(targetsFor('storage', WELCOME.perturbation_targets)).toEqual(['attn.qkv', 'ln2']);
    expect(targetsFor('calculation', WELCOME.perturbation_targets)).toEqual(['embed', 'final_norm']);
    expect(targetsFor('system', {})).toEqual([]);
  });

  it('warns where a LayerNorm undoes a constant: on the residual stream and what is added to it', () => {
    expect(removedByLayerNorm({ kind: 'system', target: 'resid_post', noise: 'constant' })).toBe(true);
    expect(removedByLayerNorm({ kind: 'calculation', target: 'attn.out', noise: 'constant' })).toBe(true);
    expect(removedByLayerNorm({ kind: 'calculation', target: 'mlp.post', noise: 'constant' })).toBe(false);  // a GeLU follows
    expect(removedByLayerNorm({ kind: 'system', target: 'resid_post', noise: 'gaussian' })).toBe(false);
    expect(removedByLayerNorm({ kind: 'storage', target: 'attn.proj', noise: 'constant' })).toBe(true);  // x (W + c) = x W + c sum(x)
    expect(removedByLayerNorm({ kind: 'storage', target: 'attn.qkv', noise: 'constant' })).toBe(false);
  });

  it('rejects a generation the server refuses, and applies perturbations when the server reports the set', async () => {
    const connection = await connected((message, reply) => {
      welcoming(message, reply);
      if (message.type === 'generate' && (message.prompts as string[])[0] === 'busy') reply({ type: 'error', code: 'busy', message: 'a generation is running; wait for it to finish.', id: message.id });
      if (message.type === 'generate' && (message.prompts as string[])[0] === 'no id') reply({ type: 'error', code: 'bad_field', message: 'temperature must be > 0.', field: 'temperature' });
      if (message.type === 'perturb') reply({ type: 'perturbations', active: message.perturbations as object[] });
    });
    const generation = useGenerationStore(pinia);
    generation.params.prompts = ['busy'];
    await expect(generation.generate(connection.send, null, [])).rejects.toThrow(/busy/);
    expect(generation.current?.error).toMatch(/^busy: /);
    generation.params.prompts = ['no id'];  // a refusal without the request's id, before the generation started
    await expect(generation.generate(connection.send, null, [])).rejects.toThrow(/bad_field/);
    const perturbations = usePerturbationsStore(pinia);
    perturbations.add('system', 'gaussian', WELCOME.perturbation_targets);
    await perturbations.apply(connection.send, perturbations.draft);
    expect(perturbations.active).toEqual([{ id: 'system-1', kind: 'system', target: 'resid_post', noise: 'gaussian', scale: 0.5, seed: 0, layers: null, enabled: true }]);
    await perturbations.apply(connection.send, []);
    expect(perturbations.active).toEqual([]);
  });
});

describe('captures store', () => {
  it('keeps one generation (or, in training, one iteration) at a time', () => {
    const captures = useCapturesStore(pinia);
    const frame = (id: string | null, step: number, hook: string) => decodeDataFrame(buildFrame(
      { id, step, hook, layer: 0, prompt_index: 0, tokens: [0, 1], shape: [1], dims: ['token'], reduction: 'norm' }, [1]));
    captures.add(frame('g1', 0, 'blocks.0.attn.q'));
    captures.add(frame('g1', 1, 'blocks.0.attn.k'));
    expect([...captures.series.keys()]).toEqual(['0|blocks.0.attn.q', '0|blocks.0.attn.k']);
    captures.add(frame('g2', 0, 'blocks.0.attn.v'));
    expect([...captures.series.keys()]).toEqual(['0|blocks.0.attn.v']);
    captures.add(frame(null, 7, 'blocks.0.resid_post'));
    captures.add(frame(null, 7, 'blocks.0.mlp.out'));
    expect(captures.series.size).toBe(2);
    captures.add(frame(null, 8, 'blocks.0.resid_post'));
    expect([...captures.series.keys()]).toEqual(['0|blocks.0.resid_post']);
    expect(captures.step).toBe(8);
  });
});

describe('training store', () => {
  it('keeps every iteration and the state, and builds the control messages', () => {
    const training = useTrainingStore(pinia);
    const iteration: Omit<IterationMessage, 'iteration'> = { type: 'iteration', lm_loss: 5, lr: 1e-3, grad_norm: 1.5, skipped: false, activation_norms: [1, 2], grad_norms: [0.1, 0.2], state: 'running' };
    training.handle({ ...iteration, iteration: 1 });
    training.handle({ ...iteration, iteration: 2 });
    training.handle({ type: 'training_state', state: 'paused', iteration: 1 });  // iteration 2 was in flight
    expect(training.iterations.map((m) => m.iteration)).toEqual([1, 2]);
    expect([training.iteration, training.state]).toEqual([2, 'paused']);
    expect(training.log.map((e) => [e.state, e.iteration])).toEqual([['paused', 1]]);
    expect(training.command('step', 2)).toEqual({ type: 'train', action: 'step', n: 2 });
    expect(training.command('pause', 2)).toEqual({ type: 'train', action: 'pause' });
  });
});
