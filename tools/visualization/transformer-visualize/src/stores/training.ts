// Training mode: one entry per iteration as it arrives, the run's state, and the controls.
import { defineStore } from 'pinia';
import { ref, shallowRef } from 'vue';
import type { IterationMessage, ServerMessage, TrainAction, TrainingState } from '../protocol/messages';

const ITERATIONS_KEPT = 2000;

export const useTrainingStore = defineStore('training', () => {
  const iterations = shallowRef<IterationMessage[]>([]);
  const iteration = ref<number | null>(null);
  const state = ref<TrainingState | null>(null);

  function handle(message: ServerMessage): void {
    if (message.type === 'iteration') {
      iterations.value = [...iterations.value, message].slice(-ITERATIONS_KEPT);
      iteration.value = message.iteration;
      state.value = message.state;
    } else if (message.type === 'training_state') {
      iteration.value = message.iteration;
      state.value = message.state;
    } else if (message.type === 'welcome' && message.mode === 'training') {
      iterations.value = [];
    }
  }

  function command(action: TrainAction, n?: number): { type: 'train'; action: TrainAction; n?: number } {
    return action === 'step' ? { type: 'train', action, n: n ?? 1 } : { type: 'train', action };
  }

  return { iterations, iteration, state, handle, command };
});
