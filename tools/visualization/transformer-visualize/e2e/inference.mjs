// End-to-end, inference mode, against the real backend (tools/run_text_generation_server.py with
// --enable-ws-server): connect, two prompts, 8 tokens, tokens equal to the REST answer for the same seed,
// attention canvas painted with masked (future) keys blank, the logit attribution of every generated token
// as a layers x (heads + MLP) heatmap whose parts add up to the logit, one PCA point per token and every
// captured layer's PCA a choice away, a perturbation changes the tokens and removing it restores them, every
// perturbation target the page offers is taken by the server; a 50-token generation keeps its attention
// labels (every k-th) and each row on its own scale reaches the top color. Screenshots of every view.
//   MEGASCOPE_HTTP=http://127.0.0.1:5000 MEGASCOPE_WS=ws://127.0.0.1:5001/ node e2e/inference.mjs
import { check, connect, heatmapCell, launch, reportFailure, paintedPixels, screenshot } from './browser.mjs';

const HTTP = process.env.MEGASCOPE_HTTP;
const WS = process.env.MEGASCOPE_WS;
const PROMPTS = ['The quick brown fox', 'Once upon a time there'];
const TOKENS = 8;
const SEED = 1234;
const LONG_TOKENS = 50;
const LAYERS = 4;  // the tiny model test_megascope_page.py serves (TINY_SERVER)
const HEADS = 4;

async function generateAndRead(page) {
  await page.click('[data-test=tab-generate]');
  await page.click('[data-test=generate]');
  for (let p = 0; p < PROMPTS.length; p++) await page.waitForSelector(`[data-test=done-${p}]`, { timeout: 120000 });
  return page.$$eval('[data-test^=stream-]', (streams) => streams.map((stream) => ({
    prompt: [...stream.querySelectorAll('.prompt-token')].map((t) => Number(t.dataset.tokenId)),
    generated: [...stream.querySelectorAll('[data-test=gen-token]')].map((t) => Number(t.dataset.tokenId)),
  })));
}

const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
const WHITE = [255, 255, 255];
const ATTENTION = '[data-test=attention-canvas] canvas.heatmap-canvas';

/** Wait until the attention heatmap has drawn `rows` rows with `perRow` (it draws on a later animation frame). */
async function attentionDrawn(page, rows, perRow = false) {
  await page.waitForFunction(([s, n, p]) => {
    const layout = JSON.parse(document.querySelector(s)?.dataset.layout ?? 'null');
    return layout !== null && layout.rows === n && layout.perRow === p;
  }, [ATTENTION, rows, perRow], { timeout: 30000 }).catch(() => { throw new Error(`e2e: the attention heatmap did not draw ${rows} rows (per row: ${perRow})`); });
}

/** Per painted row of the attention canvas: whether one of its cells (keys 0 .. row) has the sequential
 *  scale's top color (viridis yellow, 253 231 37). */
function rowsReachingTop(page) {
  return page.$eval(ATTENTION, (canvas) => {
    const layout = JSON.parse(canvas.dataset.layout);
    const ratio = canvas.width / canvas.clientWidth;
    const { data, width } = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height);
    const result = [];
    for (let r = 0; r < layout.rows; r++) {
      let painted = false;
      let top = false;
      for (let c = 0; c <= r; c++) {
        const x = Math.floor((layout.left + (c + 0.5) * layout.cellW) * ratio);
        const y = Math.floor((layout.top + (r + 0.5) * layout.cellH) * ratio);
        const o = 4 * (y * width + x);
        if (data[o] < 250 || data[o + 1] < 250 || data[o + 2] < 250) painted = true;
        if (Math.abs(data[o] - 253) <= 2 && Math.abs(data[o + 1] - 231) <= 2 && Math.abs(data[o + 2] - 37) <= 2) top = true;
      }
      if (painted) result.push(top);
    }
    return result;
  });
}

async function main() {
  check(HTTP && WS, 'set MEGASCOPE_HTTP (the REST server, which also serves the page) and MEGASCOPE_WS');
  const { browser, page } = await launch();
  try {
    await connect(page, `${HTTP}/`, WS, 'inference');
    for (let p = 0; p < PROMPTS.length; p++) await page.fill(`[data-test=prompt-${p}]`, PROMPTS[p]);
    await page.fill('[data-test=tokens]', String(TOKENS));
    await page.fill('[data-test=seed]', String(SEED));
    // A request the server refuses: its error frame is shown, and the page can generate again.
    await page.fill('[data-test=temperature]', '0');
    await page.click('[data-test=generate]');
    const refusal = await page.waitForSelector('[data-test=errors] .error', { timeout: 60000 }).then((e) => e.textContent());
    check(/bad_field: .*\(field temperature\)/.test(refusal), `the refusal of temperature 0 reads: ${refusal}`);
    await page.waitForSelector('[data-test=generate]:enabled');
    await screenshot(page, 'error');
    await page.click('[data-test=dismiss-errors]');
    await page.fill('[data-test=temperature]', '1');
    await page.check('[data-test=attribution]');
    const baseline = await generateAndRead(page);
    check(baseline.every((s) => s.generated.length === TOKENS || s.generated.length > 0), `tokens missing: ${JSON.stringify(baseline)}`);

    const rest = await fetch(`${HTTP}/api`, {
      method: 'PUT', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ prompts: PROMPTS, tokens_to_generate: TOKENS, random_seed: SEED, temperature: 1.0, top_k: 0, top_p: 0.0 }),
    }).then((r) => r.json());
    baseline.forEach((s, p) => check(same(rest.tokens[p], [...s.prompt, ...s.generated]),
      `prompt ${p}: the page shows ${JSON.stringify(s)}, REST answered ${JSON.stringify(rest.tokens[p])}`));
    console.log(`tokens match REST: ${JSON.stringify(baseline.map((s) => s.generated))}`);

    await page.click('[data-test=stream-0] [data-test=gen-token] >> nth=2');
    await page.waitForSelector('[data-test=logit-lens]');
    await screenshot(page, 'generate');

    await page.click('[data-test=tab-vectors]');
    await screenshot(page, 'vectors');

    await page.click('[data-test=tab-attention]');
    const attention = ATTENTION;
    const tokens0 = baseline[0].prompt.length + baseline[0].generated.length;
    await page.waitForSelector(attention);
    await attentionDrawn(page, tokens0);
    const painted = await paintedPixels(page, attention);
    check(painted > 1000, `the attention heatmap canvas has ${painted} non-background pixels`);
    // A key after its query is masked: blank, not drawn as an attention of 0; the query's own key is drawn.
    // (The prefill's rows carry their masked keys as zeros: query 0, key 1 is one of them.)
    const masked = await heatmapCell(page, attention, 0, 1);
    check(same(masked.rgb, WHITE), `the masked cell (query 0, key 1) is drawn ${masked.rgb}, not blank`);
    check(!same((await heatmapCell(page, attention, 0, 0)).rgb, WHITE), 'the cell (query 0, key 0) is blank');
    await page.hover(attention, { position: { x: 200, y: 300 } });
    await screenshot(page, 'attention');
    await page.selectOption('[data-test=attn-head]', 'all');
    await screenshot(page, 'attention_heads');

    // Logit attribution: every generated token of both prompts has its layers x (heads + MLP) map, and its
    // parts add up to its logit.
    await page.click('[data-test=tab-attribution]');
    const attributed = '[data-test=attribution-canvas] canvas.heatmap-canvas';
    const seen = [];
    for (let p = 0; p < PROMPTS.length; p++) {
      await page.selectOption('[data-test=attribution-prompt]', String(p));
      for (let t = 0; t < baseline[p].generated.length; t++) {
        await page.selectOption('[data-test=attribution-token]', String(t));
        const position = String(baseline[p].prompt.length + t);  // the view shows the token chosen once it has redrawn
        const parts = await page.waitForSelector(`[data-test=attribution-parts][data-position="${position}"]`);
        const [rows, cols, id, logit, sum] = await Promise.all(['data-rows', 'data-cols', 'data-token-id', 'data-logit', 'data-sum']
          .map((a) => parts.getAttribute(a).then(Number)));
        check(id === baseline[p].generated[t], `prompt ${p} token ${t}: the attribution is of token ${id}, the page shows ${baseline[p].generated[t]}`);
        check(rows === LAYERS && cols === HEADS + 1, `prompt ${p} token ${t}: the attribution is ${rows} x ${cols}, not ${LAYERS} layers x ${HEADS} heads + MLP`);
        check(Math.abs(sum - logit) <= 1e-3 * Math.max(1, Math.abs(logit)), `prompt ${p} token ${t}: the parts add up to ${sum}, its logit is ${logit}`);
        seen.push(logit);
      }
    }
    check(new Set(seen).size > 1, `every generated token shows the same logit ${seen[0]}: the view does not follow the token chosen`);
    // the heatmap draws on a later animation frame: wait until it has painted, or fail after 10 s
    const painting = await page.waitForFunction((s) => {
      const canvas = document.querySelector(s);
      if (!canvas || canvas.width === 0) return false;
      const { data } = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height);
      let painted = 0;
      for (let i = 0; i < data.length; i += 4) if (data[i] < 250 || data[i + 1] < 250 || data[i + 2] < 250) painted += 1;
      return painted > 1000;
    }, attributed, { timeout: 10000 }).catch(() => null);
    check(painting, `the attribution heatmap canvas has ${await paintedPixels(page, attributed)} non-background pixels`);
    await page.hover(attributed, { position: { x: 300, y: 40 } });
    await screenshot(page, 'attribution');
    console.log(`attribution: ${seen.length} tokens, ${LAYERS} layers x ${HEADS} heads + MLP, parts add up to the logits`);

    await page.click('[data-test=tab-pca]');
    // One point per token the model read: every prompt token and generated token, except that the last
    // token of a prompt may never have been fed back (no vector exists for it); no token twice.
    const drawn = JSON.parse(await page.getAttribute('[data-test=pca]', 'data-tokens'));
    baseline.forEach((s, p) => {
      const length = s.prompt.length + s.generated.length;
      const indices = drawn.filter(([prompt]) => prompt === p).map(([, token]) => token).sort((a, b) => a - b);
      const read = Array.from({ length: length - 1 }, (_, i) => i);
      check(new Set(indices).size === indices.length, `PCA of prompt ${p} draws a token twice: ${indices}`);
      check(same(indices, read) || same(indices, [...read, length - 1]),
        `PCA of prompt ${p} (${length} tokens) draws tokens ${indices}`);
    });
    check(Number(await page.getAttribute('[data-test=pca]', 'data-points')) === drawn.length, 'the PCA point count is not what it draws');
    console.log(`PCA: ${drawn.length} points for ${baseline.map((s) => s.prompt.length + s.generated.length).join(' + ')} tokens`);
    // The generation asked for every captured layer's PCA: another layer is a choice here, not a new generation.
    const layers = await page.$$eval('[data-test=pca-layer] option', (options) => options.map((o) => o.value));
    check(same(layers, ['0', '1', '2', '3']), `the PCA tab offers layers ${layers}`);
    check(await page.getAttribute('[data-test=pca]', 'data-layer') === '0', 'the PCA tab does not show layer 0 first');
    const firstInfo = await page.textContent('[data-test=pca-info]');
    await page.selectOption('[data-test=pca-layer]', '2');
    await page.waitForSelector('[data-test=pca][data-layer="2"]', { timeout: 10000 });
    const secondInfo = await page.textContent('[data-test=pca-info]');
    check(/layer 2:/.test(secondInfo) && secondInfo !== firstInfo, `after choosing layer 2 the PCA reads "${secondInfo}" (was "${firstInfo}")`);
    check(same(JSON.parse(await page.getAttribute('[data-test=pca]', 'data-tokens')), drawn), 'layer 2\'s PCA draws other tokens');
    console.log(`PCA layer chosen in the tab: ${firstInfo.trim()} -> ${secondInfo.trim()}`);
    await screenshot(page, 'pca');

    await page.click('[data-test=tab-perturbations]');
    await page.click('[data-test=add-storage]');
    await page.fill('[data-test=scale-0]', '10');
    await page.click('[data-test=apply-perturbations]');
    await page.waitForSelector('[data-test=active-perturbations] .chip');
    const perturbed = await generateAndRead(page);
    check(!same(perturbed.map((s) => s.generated), baseline.map((s) => s.generated)), 'the perturbation did not change the generated tokens');
    await page.click('[data-test=tab-perturbations]');
    await page.click('[data-test=clear-perturbations]');
    await page.waitForSelector('[data-test=active-perturbations] .chip', { state: 'detached' });
    const restored = await generateAndRead(page);
    check(same(restored, baseline), `removing the perturbation did not restore the tokens: ${JSON.stringify(restored)} vs ${JSON.stringify(baseline)}`);
    console.log('perturbation changed the tokens; removing it restored them');

    await page.click('[data-test=tab-perturbations]');
    await page.click('[data-test=compare]');
    await page.waitForSelector('[data-test=compare-summary]', { timeout: 120000 });
    await page.waitForSelector('[data-test=compare]:enabled');
    await screenshot(page, 'perturbations');
    await page.click('[data-test=clear-perturbations]');
    await page.waitForSelector('[data-test=active-perturbations] .chip', { state: 'detached' });

    // Every target the page offers, of every kind, is taken by the server: the choices come from the welcome.
    let offered = 0;
    for (const kind of ['storage', 'calculation', 'system']) {
      await page.click(`[data-test=add-${kind}]`);
      const row = (await page.$$('[data-test^=target-]')).length - 1;
      const targets = await page.$$eval(`[data-test=target-${row}] option`, (options) => options.map((o) => o.value));
      check(targets.length > 0, `the page offers no ${kind} target`);
      for (const target of targets) {
        await page.selectOption(`[data-test=target-${row}]`, target);
        await page.click('[data-test=apply-perturbations]');
        const shown = await page.waitForFunction(([k, t]) => [...document.querySelectorAll('[data-test=active-perturbations] .chip')]
          .some((chip) => chip.textContent.includes(`: ${k} ${t} `)), [kind, target], { timeout: 30000 }).catch(() => null);
        const refusal = await page.$$eval('[data-test=errors] .error', (nodes) => nodes.map((n) => n.textContent.trim()));
        check(shown && !refusal.length, `the server did not take the offered ${kind} target ${target}: ${refusal.join(' | ')}`);
        offered += 1;
      }
    }
    console.log(`every offered perturbation target was taken: ${offered}`);
    await page.click('[data-test=clear-perturbations]');
    await page.waitForSelector('[data-test=active-perturbations] .chip', { state: 'detached' });

    // A long generation: the labels thin out to every k-th token instead of vanishing, and each row on
    // its own scale gives every query's most attended key the top color.
    await page.click('[data-test=tab-generate]');
    await page.fill('[data-test=tokens]', String(LONG_TOKENS));
    const long = await generateAndRead(page);
    const longTokens = long[0].prompt.length + long[0].generated.length;
    await page.click('[data-test=tab-attention]');
    await attentionDrawn(page, longTokens);
    const { layout } = await heatmapCell(page, attention, 0, 0);
    const labelPixels = await page.$eval(attention, (canvas, left) => {
      if (left < 10) return 0;  // no room was left for labels
      const ratio = canvas.width / canvas.clientWidth;
      const { data } = canvas.getContext('2d').getImageData(0, 0, Math.floor(left * ratio) - 2, canvas.height);
      let n = 0;
      for (let i = 0; i < data.length; i += 4) if (data[i] < 200) n += 1;
      return n;
    }, layout.left);
    check(layout.rowStride > 1 && labelPixels > 100,
      `${longTokens} tokens: row labels every ${layout.rowStride} rows, ${labelPixels} label pixels left of the map`);
    await page.check('[data-test=attn-per-row]');
    await attentionDrawn(page, longTokens, true);
    const reaching = await rowsReachingTop(page);
    check(reaching.length >= longTokens / 2 && reaching.every(Boolean),
      `each row on its own scale: ${reaching.filter(Boolean).length} of ${reaching.length} painted rows reach the top color`);
    console.log(`${longTokens} tokens: labels every ${layout.rowStride} rows; all ${reaching.length} painted rows reach the top color on their own scale`);
  } catch (error) {
    await reportFailure(page);
    throw error;
  } finally {
    await browser.close();
  }
}

main().then(() => console.log('e2e inference: passed'), (error) => {
  console.error(error.message);
  process.exit(1);
});
