// Data frames as they arrive. Kept outside Vue's deep reactivity (typed arrays of thousands of values):
// views watch `version` and redraw.
import { defineStore } from 'pinia';
import { markRaw, ref } from 'vue';
import type { DataFrame } from '../protocol/dataFrame';
import { addFrame, type CaptureSeries } from '../lib/captureSeries';
import { nextFrame } from '../lib/nextFrame';

export const useCapturesStore = defineStore('captures', () => {
  const series = markRaw(new Map<string, CaptureSeries>());
  const version = ref(0);
  const frames = ref(0);
  const step = ref<number | null>(null);
  let source: { id: string | null; step: number } | null = null;  // what the shown frames came from

  /** A new generation (id) or, in training, a new iteration (step) replaces what was shown. */
  function add(frame: DataFrame): void {
    const { id } = frame.header;
    if (source && (source.id !== id || (id === null && source.step !== frame.header.step))) series.clear();
    source = { id, step: frame.header.step };
    step.value = frame.header.step;
    addFrame(series, frame);
    frames.value += 1;
    publish();
  }

  // Frames arrive one per message, hundreds a second: the views redraw once per animation frame at most.
  let pending = false;
  function publish(): void {
    if (pending) return;
    pending = true;
    nextFrame(() => {
      pending = false;
      version.value += 1;
    });
  }

  function clear(): void {
    series.clear();
    source = null;
    step.value = null;
    publish();
  }

  return { series, version, frames, step, add, clear };
});
