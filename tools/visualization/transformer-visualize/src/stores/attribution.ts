// Direct logit attribution of the shown generation: one entry per generated token, by (prompt, position).
import { defineStore } from 'pinia';
import { shallowRef } from 'vue';
import type { DataFrame } from '../protocol/dataFrame';
import { attributionKey, readAttribution, type TokenAttribution } from '../lib/attribution';

export const useAttributionStore = defineStore('attribution', () => {
  const tokens = shallowRef(new Map<string, TokenAttribution>());

  function add(frame: DataFrame): void {
    const entry = readAttribution(frame);
    const next = new Map(tokens.value);
    next.set(attributionKey(entry.promptIndex, entry.position), entry);
    tokens.value = next;
  }

  function clear(): void {
    tokens.value = new Map();
  }

  function at(promptIndex: number, position: number): TokenAttribution | undefined {
    return tokens.value.get(attributionKey(promptIndex, position));
  }

  return { tokens, add, clear, at };
});
