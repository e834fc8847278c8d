// Perturbations: the set being edited in the page, and the active set the server reports (shared by
// every client of the model).
import { defineStore } from 'pinia';
import { ref } from 'vue';
import type { ClientMessage, Perturbation, PerturbationKind, ServerMessage } from '../protocol/messages';

type Send = (message: ClientMessage) => boolean;

const STORAGE_TARGETS = ['attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2', 'ln1', 'embed'];

/** What each kind may target (docs/megascope_protocol.md, "Perturbation"): calculation noise goes on a
 *  per-layer hook's output, so its targets are the per-layer hooks the welcome declares. */
export function targetsFor(kind: PerturbationKind, declaredHooks: string[]): string[] {
  if (kind === 'storage') return STORAGE_TARGETS;
  if (kind === 'system') return ['resid'];
  return declaredHooks.filter((h) => h.startsWith('blocks.{l}.') && !h.endsWith('.pattern')).map((h) => h.slice('blocks.{l}.'.length));
}

export const usePerturbationsStore = defineStore('perturbations', () => {
  const draft = ref<Perturbation[]>([]);
  const active = ref<Perturbation[]>([]);
  let counter = 0;

  function add(kind: PerturbationKind, noise: string, declaredHooks: string[]): Perturbation {
    counter += 1;
    const perturbation: Perturbation = { id: `${kind}-${counter}`, kind, target: targetsFor(kind, declaredHooks)[0] ?? '', noise, scale: 0.5, seed: 0, layers: null, enabled: true };
    draft.value.push(perturbation);
    return perturbation;
  }

  function remove(id: string): void {
    draft.value = draft.value.filter((p) => p.id !== id);
  }

  const acknowledged: (() => void)[] = [];

  /** Replace the server's active set; settles when the server reports the new set. */
  function apply(send: Send, perturbations: Perturbation[]): Promise<void> {
    if (!send({ type: 'perturb', perturbations: perturbations.map((p) => ({ ...p })) })) return Promise.reject(new Error('not connected'));
    return new Promise((resolve) => acknowledged.push(resolve));
  }

  function handle(message: ServerMessage): void {
    if (message.type === 'perturbations') {
      active.value = message.active;
      acknowledged.shift()?.();
    }
    if (message.type === 'welcome') active.value = [];
  }

  return { draft, active, add, remove, apply, handle };
});
