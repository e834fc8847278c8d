// One schedule for every heatmap of the page: the canvases due for a redraw are drawn together on one
// animation frame, and the next such frame waits until drawing has taken at most a fifth of the time since.
// Spaced each on its own, 32 heads' small multiples would each take their fifth, and while a generation
// streams in the page would draw instead of reading the frames it is behind on. Once the stream is over
// (`drawPromptly`), the spacing has nothing left to protect: the last frames are drawn on the coming frame.

type Draw = () => void;

const SHARE = 5;  // drawing gets one part in SHARE of the main thread while redraws keep coming
const pending = new Set<Draw>();
let timer: ReturnType<typeof setTimeout> | null = null;
let frame = 0;
let lastEnd = 0;
let lastCost = 0;
let prompt = false;  // the next draw waits for no spacing

/** Draw on a coming animation frame (once, however often it is asked before then). */
export function requestDraw(draw: Draw): void {
  pending.add(draw);
  if (timer !== null || frame !== 0) return;
  const wait = prompt ? 0 : Math.max(0, lastEnd + (SHARE - 1) * lastCost - performance.now());
  timer = setTimeout(() => {
    timer = null;
    frame = requestAnimationFrame(drawPending);
  }, wait);
}

/** No more redraws are coming (a generation has ended): the draw waiting, or the next one asked for, happens on
 *  the coming animation frame. */
export function drawPromptly(): void {
  prompt = true;
  if (timer === null) return;
  clearTimeout(timer);
  timer = null;
  frame = requestAnimationFrame(drawPending);
}

/** Forget a draw asked for (its canvas is going away). */
export function cancelDraw(draw: Draw): void {
  pending.delete(draw);
}

function drawPending(): void {
  frame = 0;
  prompt = false;
  const start = performance.now();
  const due = [...pending];
  pending.clear();
  for (const draw of due) draw();
  lastEnd = performance.now();
  lastCost = lastEnd - start;
}
