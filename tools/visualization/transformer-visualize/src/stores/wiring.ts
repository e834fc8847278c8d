// Routes what the connection receives to the stores that keep it.
import type { Pinia } from 'pinia';
import { isAttributionFrame } from '../lib/attribution';
import { drawPromptly } from '../lib/drawScheduler';
import { useAttributionStore } from './attribution';
import { useCapturesStore } from './captures';
import { useConnectionStore } from './connection';
import { useGenerationStore } from './generation';
import { usePerturbationsStore } from './perturbations';
import { useTrainingStore } from './training';

export function wireStores(pinia: Pinia): void {
  const connection = useConnectionStore(pinia);
  const generation = useGenerationStore(pinia);
  const perturbations = usePerturbationsStore(pinia);
  const training = useTrainingStore(pinia);
  const captures = useCapturesStore(pinia);
  const attribution = useAttributionStore(pinia);
  connection.onMessage((message) => {
    if (message.type === 'generation_started') {
      captures.clear();
      attribution.clear();
    }
    if (message.type === 'generation_done') drawPromptly();
    generation.handle(message);
    perturbations.handle(message);
    training.handle(message);
  });
  connection.onData((frame) => (isAttributionFrame(frame) ? attribution.add(frame) : captures.add(frame)));
}
