// Training mode: one entry per iteration as it arrives, the run's state, and the controls.
import { defineStore } from 'pinia';
import { ref, shallowRef } from 'vue';
import type { IterationMessage, ServerMessage, TrainAction, TrainingState } from '../protocol/messages';

const ITERATIONS_KEPT = 2000;
const LOG_KEPT = 50;

/** One control reply: the state the run went into and the iteration it was at. */
export interface ControlEntry {
  state: TrainingState;
  iteration: number;
  at: Date;
}

export const useTrainingStore = defineStore('training', () => {
  const iterations = shallowRef<IterationMessage[]>([]);
  const iteration = ref<number | null>(null);
  const state = ref<TrainingState | null>(null);
  const log = ref<ControlEntry[]>([]);

  function handle(message: ServerMessage): void {
    if (message.type === 'iteration') {
      iterations.value = [...iterations.value, message].slice(-ITERATIONS_KEPT);
      iteration.value = message.iteration;
      state.value = message.state;
    } else if (message.type === 'training_state') {
      // An iteration in flight when a pause arrives still finishes (and is reported as paused): the
      // counter never goes back.
      iteration.value = Math.max(iteration.value ?? 0, message.iteration);
      state.value = message.state;
      log.value = [...log.value, { state: message.state, iteration: message.iteration, at: new Date() }].slice(-LOG_KEPT);
    } else if (message.type === 'welcome' && message.mode === 'training') {
      iterations.value = [];
      log.value = [];
    }
  }

  function command(action: TrainAction, n?: number): { type: 'train'; action: TrainAction; n?: number } {
    return action === 'step' ? { type: 'train', action, n: n ?? 1 } : { type: 'train', action };
  }

  return { iterations, iteration, state, log, handle, command };
});
