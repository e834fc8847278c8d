// The JSON messages of the MegaScope protocol (docs/megascope_protocol.md), as TypeScript types.
// The page only sends what is declared here and reads only these fields of what it receives.

export const PROTOCOL_VERSION = 3;

export interface ModelInfo {
  num_layers: number;
  hidden_size: number;
  num_attention_heads: number;
  num_query_groups: number;
  vocab_size: number;
  tp: number;
  pp: number;
  dp: number;
}

export interface Welcome {
  type: 'welcome';
  protocol: number;
  mode: 'inference' | 'training';
  model: ModelInfo;
  hooks: string[];
  reductions: string[];
  noise: string[];
  /** What each perturbation kind may target, as the server validates it. */
  perturbation_targets: Record<PerturbationKind, string[]>;
  limits: Record<string, unknown>;
}

export interface CaptureSpec {
  hooks: string[];
  layers: [number, number] | null;
  tokens: [number, number] | null;
  reduction: string;
  reductions?: Record<string, string>;
  topk: number;
  logit_lens: boolean;
  pca: { hook: string; layer: number | null } | null;
  sample?: number;
  /** Direct logit attribution of every generated token (inference only). */
  attribution?: boolean;
}

export type PerturbationKind = 'storage' | 'calculation' | 'system';

export interface Perturbation {
  id: string;
  kind: PerturbationKind;
  target: string;
  noise: string;
  scale: number;
  seed: number;
  layers: number[] | null;
  enabled: boolean;
}

export interface GenerateRequest {
  type: 'generate';
  id: string;
  prompts: string[];
  tokens_to_generate: number;
  temperature: number;
  top_k: number;
  top_p: number;
  random_seed: number;
  add_BOS: boolean;
  stop_tokens: number[];
  chat: boolean;
  capture: CaptureSpec | null;
}

export type TrainAction = 'pause' | 'resume' | 'step' | 'stop';

export type ClientMessage =
  | { type: 'hello'; protocol: number; token?: string }
  | GenerateRequest
  | { type: 'cancel'; id: string }
  | { type: 'set_capture'; capture: CaptureSpec }
  | { type: 'ping' }
  | { type: 'perturb'; perturbations: Perturbation[] }
  | { type: 'train'; action: TrainAction; n?: number; id?: string };

export interface Candidate {
  token_id: number;
  text: string;
  prob: number;
}

export interface SampledToken extends Candidate {
  prompt_index: number;
  logprob: number;
  topk: Candidate[];
}

export interface PromptToken {
  id: number;
  text: string;
}

export interface LensLayer {
  layer: number;
  topk: Candidate[];
}

export interface PcaPoint {
  prompt_index: number;
  token_index: number;
  text: string;
  x: number;
  y: number;
}

export type ServerMessage =
  | Welcome
  | { type: 'generation_started'; id: string; random_seed: number; prompt_tokens: PromptToken[][] }
  | { type: 'token'; id: string; step: number; tokens: SampledToken[] }
  | { type: 'logit_lens'; id: string; step: number; prompt_index: number; layers: LensLayer[] }
  | PcaMessage
  | GenerationDone
  | { type: 'capture_set'; capture: CaptureSpec | null }
  | { type: 'perturbations'; active: Perturbation[] }
  | IterationMessage
  | { type: 'training_state'; state: TrainingState; iteration: number }
  | { type: 'dropped'; frames: number }
  | { type: 'pong' }
  | ErrorFrame;

export type TrainingState = 'running' | 'paused' | 'stopping';

export interface PcaMessage {
  type: 'pca';
  id: string;
  hook: string;
  layer: number | null;
  points: PcaPoint[];
  explained_variance: [number, number];
}

export interface GenerationDone {
  type: 'generation_done';
  id: string;
  texts: string[];
  tokens: number[][];
  finish_reason: string[];
  dropped_frames: number;
}

export interface IterationMessage {
  type: 'iteration';
  iteration: number;
  lm_loss: number;
  lr: number;
  grad_norm: number | null;
  skipped: boolean;
  activation_norms: number[];
  grad_norms: number[];
  state: TrainingState;
}

export interface ErrorFrame {
  type: 'error';
  code: string;
  message: string;
  field?: string;
  id?: string;
}

/** Parse one text frame; a frame that is not a JSON object with a string "type" is reported as a page-side error. */
export function parseServerMessage(text: string): ServerMessage {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return { type: 'error', code: 'bad_json', message: `the server sent a text frame that is not JSON: ${text.slice(0, 80)}` };
  }
  if (typeof value !== 'object' || value === null || typeof (value as { type?: unknown }).type !== 'string') {
    return { type: 'error', code: 'bad_json', message: 'the server sent a JSON frame without a "type"' };
  }
  return value as ServerMessage;
}
