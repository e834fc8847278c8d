/** Run `callback` before the next repaint; in a hidden tab (no repaints) or in Node, on the next task, so
 *  that work handed over in batches never piles up waiting for the tab to be shown. */
export function nextFrame(callback: () => void): void {
  const visible = typeof document !== 'undefined' && !document.hidden;
  if (visible && typeof requestAnimationFrame === 'function') requestAnimationFrame(() => callback());
  else setTimeout(callback, 0);
}
