// Inference: the request being edited, the generation streaming in, its logit lens and PCA, and the
// runs kept for the with/without-perturbations comparison.
import { defineStore } from 'pinia';
import { computed, reactive, ref, shallowRef } from 'vue';
import type { CaptureSpec, ClientMessage, GenerationDone, LensLayer, PcaMessage, Perturbation, PromptToken, SampledToken, ServerMessage } from '../protocol/messages';
import type { CaptureChoices } from '../lib/captureChoices';

export interface StreamedToken extends SampledToken {
  step: number;
}

export interface Generation {
  id: string;
  prompts: string[];
  seed: number | null;
  promptTokens: PromptToken[][];
  generated: StreamedToken[][];
  done: GenerationDone | null;
  error: string | null;            // the error frame that ended it, if one did
  perturbations: Perturbation[];   // the active set while it ran
}

export interface GenerationParams {
  prompts: string[];
  tokensToGenerate: number;
  temperature: number;
  topK: number;
  topP: number;
  seed: number;
  addBos: boolean;
}

type Send = (message: ClientMessage) => boolean;

const HISTORY_KEPT = 20;

export const useGenerationStore = defineStore('generation', () => {
  const params = reactive<GenerationParams>({
    prompts: ['The quick brown fox', 'Once upon a time'], tokensToGenerate: 8, temperature: 1, topK: 0, topP: 0, seed: 1234, addBos: false,
  });
  const capture = reactive<CaptureChoices>({
    hooks: [], allLayers: true, layerStart: 0, layerEnd: 1, reduction: 'none', perHook: {}, topk: 5, logitLens: false, pcaHook: '', pcaLayer: null, attribution: false,
  });
  const current = ref<Generation | null>(null);
  const history = ref<Generation[]>([]);
  const lens = shallowRef(new Map<string, LensLayer[]>());
  // One pca message per layer asked for (pca.layer null: every captured layer); the PCA tab shows the chosen one.
  const pcas = shallowRef<PcaMessage[]>([]);
  const pcaLayer = ref<number | null>(null);  // the layer shown; null: the first that arrived
  const pca = computed(() => pcas.value.find((m) => m.layer === pcaLayer.value) ?? pcas.value[0] ?? null);
  const selected = ref<{ promptIndex: number; step: number } | null>(null);
  const comparison = ref<{ without: Generation; with: Generation } | null>(null);  // the last with/without pair
  let counter = 0;
  const waiting = new Map<string, { resolve: (done: GenerationDone) => void; reject: (error: Error) => void }>();

  /** Start a generation; the promise settles with its generation_done, or fails on an error frame naming it. */
  function generate(send: Send, spec: CaptureSpec | null, activePerturbations: Perturbation[]): Promise<GenerationDone> {
    counter += 1;
    const id = `page-${Date.now().toString(36)}-${counter}`;
    const prompts = params.prompts.filter((p) => p.trim() !== '');
    current.value = { id, prompts, seed: params.seed, promptTokens: [], generated: prompts.map(() => []), done: null, error: null, perturbations: activePerturbations };
    lens.value = new Map();
    pcas.value = [];
    selected.value = null;
    const sent = send({
      type: 'generate', id, prompts, tokens_to_generate: params.tokensToGenerate, temperature: params.temperature,
      top_k: params.topK, top_p: params.topP, random_seed: params.seed, add_BOS: params.addBos, stop_tokens: [], chat: false,
      capture: spec,
    });
    if (!sent) return Promise.reject(new Error('not connected'));
    return new Promise((resolve, reject) => waiting.set(id, { resolve, reject }));
  }

  function handle(message: ServerMessage): void {
    const run = current.value;
    switch (message.type) {
      case 'generation_started':
        if (run && run.id === message.id) {
          run.promptTokens = message.prompt_tokens;
          run.seed = message.random_seed;
        }
        break;
      case 'token':
        if (run && run.id === message.id) {
          for (const token of message.tokens) run.generated[token.prompt_index]?.push({ ...token, step: message.step });
        }
        break;
      case 'logit_lens':
        if (run && run.id === message.id) {
          const next = new Map(lens.value);
          next.set(`${message.prompt_index}|${message.step}`, message.layers);
          lens.value = next;
        }
        break;
      case 'pca':
        if (run && run.id === message.id) pcas.value = [...pcas.value, message];
        break;
      case 'generation_done':
        if (run && run.id === message.id) {
          run.done = message;
          history.value = [run, ...history.value].slice(0, HISTORY_KEPT);
        }
        waiting.get(message.id)?.resolve(message);
        waiting.delete(message.id);
        break;
      case 'error': {
        // The refusal of a generate names its id; one without an id that comes before the generation
        // started is taken as that refusal too (a server may not have read the id of a malformed request).
        const pending = run !== null && run.done === null && run.error === null && run.promptTokens.length === 0;
        const id = message.id !== undefined ? String(message.id) : pending ? run!.id : undefined;
        if (id === undefined) break;
        if (run && id === run.id) run.error = `${message.code}: ${message.message}`;
        waiting.get(id)?.reject(new Error(`${message.code}: ${message.message}`));
        waiting.delete(id);
        break;
      }
    }
  }

  function lensFor(promptIndex: number, step: number): LensLayer[] | undefined {
    return lens.value.get(`${promptIndex}|${step}`);
  }

  return { params, capture, current, history, lens, pcas, pcaLayer, pca, selected, comparison, generate, handle, lensFor };
});
