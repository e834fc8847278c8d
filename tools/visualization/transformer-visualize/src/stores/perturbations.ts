// Perturbations: the set being edited in the page, and the active set the server reports (shared by
// every client of the model).
import { defineStore } from 'pinia';
import { ref } from 'vue';
import type { ClientMessage, Perturbation, PerturbationKind, ServerMessage } from '../protocol/messages';

type Send = (message: ClientMessage) => boolean;

export type DeclaredTargets = Partial<Record<PerturbationKind, string[]>>;

/** What a kind may target: exactly what the server's welcome declares (`perturbation_targets`), so the page
 *  never offers a target the server refuses. */
export function targetsFor(kind: PerturbationKind, declared: DeclaredTargets): string[] {
  return declared[kind] ?? [];
}

// Where a constant becomes the same shift of every hidden value of a token, which reaches the rest of the
// model only through a LayerNorm: the residual stream (system), what is added to it (calculation embed,
// attn.out, mlp.out), and the weights that write it (storage embed, attn.proj, mlp.fc2: x (W + c) adds
// c * sum(x) to every output; a tied output layer's logits shift alike, which the softmax ignores).
const READ_THROUGH_NORMS: Partial<Record<PerturbationKind, string[]>> = {
  system: ['resid_post'], calculation: ['embed', 'attn.out', 'mlp.out'], storage: ['embed', 'attn.proj', 'mlp.fc2'],
};

/** Whether a LayerNorm model undoes this perturbation: the next LayerNorm subtracts the mean of the hidden
 *  values, and with it any shift of all of them alike (an RMSNorm model feels it). */
export function removedByLayerNorm(p: Pick<Perturbation, 'kind' | 'target' | 'noise'>): boolean {
  return p.noise === 'constant' && (READ_THROUGH_NORMS[p.kind] ?? []).includes(p.target);
}

export const usePerturbationsStore = defineStore('perturbations', () => {
  const draft = ref<Perturbation[]>([]);
  const active = ref<Perturbation[]>([]);
  let counter = 0;

  function add(kind: PerturbationKind, noise: string, declared: DeclaredTargets): Perturbation {
    counter += 1;
    const perturbation: Perturbation = { id: `${kind}-${counter}`, kind, target: targetsFor(kind, declared)[0] ?? '', noise, scale: 0.5, seed: 0, layers: null, enabled: true };
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
