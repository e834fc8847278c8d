// End-to-end at a large model's shape (issue 60): a 32-layer, 32-head model (8 query groups, as Llama-3-8B)
// generates 96 tokens after a 32-token prompt, 128 in all, with the page's default capture (Q, K, V, the
// attention pattern of every head and the residual stream at every layer, the logit lens, the PCA of every
// layer) and the logit attribution. The generation is recorded from the real backend, then replayed to the
// page at wire speed (replay.mjs) while the Attention tab shows all heads; from the last frame's arrival at the
// page, every view must show the whole generation within RENDER_BUDGET_MS (and within DELIVERY_BUDGET_MS of the
// replay's last write): what each one shows is checked too.
//   MEGASCOPE_HTTP=http://127.0.0.1:5000 MEGASCOPE_WS=ws://127.0.0.1:5001/ node e2e/scale.mjs
import { check, connect, heatmapCell, launch, reportFailure, screenshot } from './browser.mjs';
import { startReplay } from './replay.mjs';

const HTTP = process.env.MEGASCOPE_HTTP;
const WS = process.env.MEGASCOPE_WS;
const LAYERS = 32;
const HEADS = 32;
const GROUPS = 8;
const D_HEAD = 4;           // hidden 128 / 32 heads (test_megascope_page.py says why the hidden size is small)
const HIDDEN = HEADS * D_HEAD;
// 32 tokens in the server's GPT-2 BPE vocabulary (datasets/gpt); checked below
const PROMPT = 'The quick brown fox jumps over the lazy dog, and then it runs into the forest where the old trees stand tall.';
const PROMPT_TOKENS = 32;
const GENERATED = 96;
const TOKENS = PROMPT_TOKENS + GENERATED;
const RENDER_BUDGET_MS = 2000;
const DELIVERY_BUDGET_MS = 4000;
const WHITE = [255, 255, 255];
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
const HEAD_CANVASES = '[data-test=attention-heads] canvas.heatmap-canvas';
const ATTENTION = '[data-test=attention-canvas] canvas.heatmap-canvas';
const VECTORS = { 'attn.q': HIDDEN, 'attn.k': GROUPS * D_HEAD, 'attn.v': GROUPS * D_HEAD, resid_post: HIDDEN };

const TRIANGLE = (TOKENS * (TOKENS + 1)) / 2;  // the cells of a causal attention matrix: each query's keys up to itself
const SHAPE = { LAYERS, HEADS, TOKENS, TRIANGLE, VECTORS, HEAD_CANVASES, ATTENTION };

// Each view: how to show it; when it shows the whole generation (`rendered(SHAPE)`, evaluated in the page on
// every animation frame while the clock runs, so it reads only what each heatmap says it drew: HeatmapCanvas's
// data-layout, with `colored` the cells that hold a value); what it must show (read off the clock).
const VIEWS = [
  {
    name: 'attention, all heads',
    show: async () => {},  // shown while the generation streamed in
    // every head's whole triangle, whose last row only the final pass after the last step carries
    rendered: (s) => {
      const layouts = [...document.querySelectorAll(s.HEAD_CANVASES)].map((c) => JSON.parse(c.dataset.layout ?? 'null'));
      return layouts.length === s.HEADS && layouts.every((l) => l?.rows === s.TOKENS && l.colored === s.TRIANGLE);
    },
    check: async (page) => {
      const captions = await page.$$eval('[data-test=attention-heads] figcaption', (nodes) => nodes.map((n) => n.textContent.trim()));
      check(same(captions, Array.from({ length: HEADS }, (_, h) => `head ${h}`)), `the heads shown are ${captions}`);
      const layouts = await page.$$eval(HEAD_CANVASES, (nodes) => nodes.map((n) => JSON.parse(n.dataset.layout)));
      check(layouts.every((l) => l.rows === TOKENS && l.cols === TOKENS), `head matrices: ${layouts.map((l) => `${l.rows}x${l.cols}`)}`);
    },
  },
  {
    name: 'attention, one head',
    show: (page) => page.selectOption('[data-test=attn-head]', '0'),
    rendered: (s) => {
      const layout = JSON.parse(document.querySelector(s.ATTENTION)?.dataset.layout ?? 'null');
      return layout?.rows === s.TOKENS && layout.colored === s.TRIANGLE;
    },
    check: async (page) => {
      const heads = await page.$$eval('[data-test=attn-head] option', (options) => options.length - 1);  // and "all heads"
      check(heads === HEADS, `the head selector offers ${heads} heads, not ${HEADS}`);
      const layers = await page.$$eval('[data-test=attn-layer] option', (options) => options.length);
      check(layers === LAYERS, `the layer selector offers ${layers} layers`);
      const counted = await page.textContent('[data-test=attention-tokens]');
      check(counted.startsWith(`${TOKENS} tokens`), `the attention view reads "${counted}"`);
      // the causal triangle: each query's keys up to itself painted, the keys after it blank
      for (const [row, col, painted] of [[0, 0, true], [0, 1, false], [TOKENS - 1, TOKENS - 1, true],
        [PROMPT_TOKENS, PROMPT_TOKENS + 1, false], [TOKENS - 2, TOKENS - 1, false]]) {
        const { rgb } = await heatmapCell(page, ATTENTION, row, col);
        check(same(rgb, WHITE) !== painted, `query ${row}, key ${col} is drawn ${rgb}: it should be ${painted ? 'painted' : 'blank'}`);
      }
    },
  },
  {
    name: 'token stream and logit lens',
    show: async (page) => {
      await page.click('[data-test=tab-generate]');
      await page.click(`[data-test=stream-0] [data-test=gen-token] >> nth=${GENERATED - 1}`);
    },
    rendered: (s) => document.querySelectorAll('[data-test=logit-lens] tr').length === s.LAYERS,
    check: async (page) => {
      const prompt = await page.$$eval('[data-test=stream-0] .prompt-token', (nodes) => nodes.length);
      const generated = await page.$$eval('[data-test=stream-0] [data-test=gen-token]', (nodes) => nodes.length);
      check(prompt === PROMPT_TOKENS && generated === GENERATED, `the stream shows ${prompt} prompt and ${generated} generated tokens`);
      check((await page.textContent('[data-test=done-0]')) === '[length]', 'the stream does not show the generation as done');
      const lens = await page.$$eval('[data-test=logit-lens] tr', (rows) => rows.map((r) => [r.querySelector('th').textContent, r.querySelectorAll('td').length]));
      check(same(lens, Array.from({ length: LAYERS }, (_, l) => [`layer ${l}`, 5])), `the logit lens shows ${JSON.stringify(lens)}`);
    },
  },
  {
    name: 'vectors',
    show: (page) => page.click('[data-test=tab-vectors]'),
    // at the newest token: the last one, which the final pass read
    rendered: (s) => Object.entries(s.VECTORS).every(([hook, cols]) => {
      const figure = document.querySelector(`[data-test="heatmap-${hook}"]`);
      const layout = JSON.parse(figure?.querySelector('canvas.heatmap-canvas').dataset.layout ?? 'null');
      return layout?.rows === s.LAYERS && layout.cols === cols && layout.colored === s.LAYERS * cols
        && figure.textContent.includes(`at token ${s.TOKENS - 1}`);
    }),
    check: async (page, recording) => {
      const frames = recording.frames - GENERATED;  // the attribution frames are the Attribution tab's
      const shown = await page.textContent('[data-test=frames-received]');
      check(shown === `${frames} data frames received`, `the page counts "${shown}", the backend sent ${frames} data frames`);
    },
  },
  {
    name: 'attribution',
    show: (page) => page.click('[data-test=tab-attribution]'),
    // the newest generated token's map, every layer's heads and MLP
    rendered: (s) => {
      const layout = JSON.parse(document.querySelector('[data-test=attribution-canvas] canvas.heatmap-canvas')?.dataset.layout ?? 'null');
      return document.querySelector(`[data-test=attribution-parts][data-position="${s.TOKENS - 1}"]`) !== null
        && layout?.rows === s.LAYERS && layout.colored === s.LAYERS * (s.HEADS + 1);
    },
    check: async (page) => {
      const parts = await page.$('[data-test=attribution-parts]');
      const [rows, cols, logit, sum] = await Promise.all(['data-rows', 'data-cols', 'data-logit', 'data-sum'].map((a) => parts.getAttribute(a).then(Number)));
      check(rows === LAYERS && cols === HEADS + 1, `the attribution map is ${rows} x ${cols}, not ${LAYERS} layers x ${HEADS} heads + MLP`);
      check(Math.abs(sum - logit) <= 1e-3 * Math.max(1, Math.abs(logit)), `the parts add up to ${sum}, the logit is ${logit}`);
      const tokens = await page.$$eval('[data-test=attribution-token] option', (options) => options.length);
      check(tokens === GENERATED, `the attribution offers ${tokens} generated tokens`);
    },
  },
  {
    name: 'PCA',
    show: (page) => page.click('[data-test=tab-pca]'),
    rendered: (s) => document.querySelector('[data-test=pca]')?.dataset.points === String(s.TOKENS),
    check: async (page) => {
      const drawn = JSON.parse(await page.getAttribute('[data-test=pca]', 'data-tokens'));
      check(same(drawn, Array.from({ length: TOKENS }, (_, t) => [0, t])), `the PCA draws tokens ${JSON.stringify(drawn)}`);
      const layers = await page.$$eval('[data-test=pca-layer] option', (options) => options.map((o) => Number(o.value)));
      check(same(layers, Array.from({ length: LAYERS }, (_, l) => l)), `the PCA tab offers layers ${layers}`);
    },
  },
];

/** In the page, before its own script: when the generation's last message (generation_done) reached the page,
 *  by a listener added to each WebSocket the page opens (the page's own listeners are untouched). It splits the
 *  time after the replay's last write in two: the frames still in flight then (several MB in the kernel's and
 *  Chromium's buffers, which reach the page as fast as it takes its messages: a page busy drawing falls behind
 *  here), and the views shown after the last one came. */
function stampGenerationDone() {
  const PageSocket = globalThis.WebSocket;
  globalThis.WebSocket = class extends PageSocket {
    constructor(...args) {
      super(...args);
      this.addEventListener('message', (event) => {
        if (typeof event.data === 'string' && JSON.parse(event.data).type === 'generation_done') globalThis.generationDoneAt = performance.now();
      });
    }
  };
}

/** Wait until `view` shows what its `rendered` says (polled on every animation frame); then the page's clock,
 *  one round trip late at most. */
async function renderedAt(page, view) {
  await page.waitForFunction(view.rendered, SHAPE, { timeout: 60000 })
    .catch(() => { throw new Error(`e2e: the ${view.name} view did not show the whole generation within 60 s`); });
  return page.evaluate(() => performance.now());
}

async function main() {
  check(HTTP && WS, 'set MEGASCOPE_HTTP (the REST server, which also serves the page) and MEGASCOPE_WS');
  const replay = await startReplay(WS);
  const { browser, page } = await launch();
  try {
    await page.addInitScript(stampGenerationDone);
    await connect(page, `${HTTP}/`, replay.url, 'inference');
    await page.fill('[data-test=prompt-0]', PROMPT);
    await page.click('[data-test=remove-prompt-1]');
    await page.fill('[data-test=tokens]', String(GENERATED));
    await page.check('[data-test=attribution]');
    await page.click('[data-test=generate]');
    await page.click('[data-test=tab-attention]');
    await page.selectOption('[data-test=attn-head]', 'all');

    const recording = await replay.recorded;
    const started = recording.messages.find((m) => m.type === 'generation_started');
    const done = recording.messages.find((m) => m.type === 'generation_done');
    check(started?.prompt_tokens[0].length === PROMPT_TOKENS, `the prompt is ${started?.prompt_tokens[0].length} tokens, not ${PROMPT_TOKENS}`);
    check(done?.tokens[0].length === GENERATED && done.dropped_frames === 0, `the backend's generation: ${JSON.stringify(done)}`);
    // per step (the final pass included) and layer, one frame of each of the 5 hooks; one attribution frame per generated token
    check(recording.frames === (GENERATED + 1) * LAYERS * 5 + GENERATED, `the backend sent ${recording.frames} data frames`);
    console.log(`recorded: ${recording.frames} data frames (${(recording.bytes / 2 ** 20).toFixed(1)} MiB), ${recording.messages.length} messages`);

    const written = await replay.replay();
    await page.waitForFunction(() => globalThis.generationDoneAt !== undefined, null, { timeout: 60000 });
    const doneAt = await page.evaluate(() => globalThis.generationDoneAt);
    const inFlight = await page.evaluate(() => performance.timeOrigin) + doneAt - (performance.timeOrigin + written);
    let clock = doneAt;  // the page's clock from here on; the first view's lap holds the round trips since
    let total = inFlight;
    const laps = [];
    for (const view of VIEWS) {
      await view.show(page);
      const lap = await renderedAt(page, view) - clock;
      total += lap;
      laps.push(`${view.name} ${lap.toFixed(0)} ms`);
      await view.check(page, recording);
      await screenshot(page, `scale_${view.name.replace(/\W+/g, '_')}`);
      clock = await page.evaluate(() => performance.now());
    }
    const rendered = total - inFlight;
    console.log(`rendered every view ${rendered.toFixed(0)} ms after the last frame reached the page (`
      + `${total.toFixed(0)} ms after the replay's last write): ${laps.join(', ')}`);
    check(rendered < RENDER_BUDGET_MS, `every view took ${rendered.toFixed(0)} ms after the last frame reached the page, over ${RENDER_BUDGET_MS} ms`);
    // A page busy drawing holds the socket's messages back: bound the delivery too, with room for a loaded machine
    // (Chromium's own delivery under DevTools took 0.3-0.65 s for these messages on an idle page).
    check(total < DELIVERY_BUDGET_MS, `the last frame reached the page and every view showed ${total.toFixed(0)} ms after the replay's last write, over ${DELIVERY_BUDGET_MS} ms`);
  } catch (error) {
    await reportFailure(page);
    throw error;
  } finally {
    await browser.close();
    await replay.close();
  }
}

main().then(() => console.log('e2e scale: passed'), (error) => {
  console.error(error.message);
  process.exit(1);
});
