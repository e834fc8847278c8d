// End-to-end, training mode, against a real run (pretrain_gpt.py --training-ws-port): live iterations,
// pause / step 2 / resume move the iteration counter by exactly what was asked, then stop.
//   MEGASCOPE_WS=ws://127.0.0.1:5002/ node e2e/training.mjs
import { check, connect, launch, reportFailure, screenshot, serveDist } from './browser.mjs';

const WS = process.env.MEGASCOPE_WS;
const STEPS = 2;

async function counter(page) {
  const [iteration, state] = await Promise.all([page.textContent('[data-test=iteration]'), page.textContent('[data-test=training-state]')]);
  return { iteration: Number(iteration), state };
}

/** Wait until the bar shows `want`: {state?, iteration?, above?} (above: iteration greater than it). */
async function waitForCounter(page, want, what) {
  await page.waitForFunction((w) => {
    const iteration = Number(document.querySelector('[data-test=iteration]')?.textContent);
    const state = document.querySelector('[data-test=training-state]')?.textContent;
    return (w.state === undefined || state === w.state) && (w.iteration === undefined || iteration === w.iteration)
      && (w.above === undefined || iteration > w.above);
  }, want, { timeout: 120000 }).catch(() => { throw new Error(`e2e: timed out waiting for ${what}`); });
}

async function main() {
  check(WS, 'set MEGASCOPE_WS to the training run\'s --training-ws-port address');
  const server = await serveDist();
  const { browser, page } = await launch();
  try {
    await connect(page, `http://127.0.0.1:${server.address().port}/`, WS, 'training');
    await waitForCounter(page, { state: 'running', above: 1 }, 'running iterations');
    await page.click('[data-test=pause]');
    await waitForCounter(page, { state: 'paused' }, 'the paused state');
    const paused = await counter(page);
    await page.fill('[data-test=step-count]', String(STEPS));
    await page.click('[data-test=step]');
    await waitForCounter(page, { state: 'paused', iteration: paused.iteration + STEPS }, `iteration ${paused.iteration + STEPS}, paused`);
    await screenshot(page, 'training');
    const stepped = await counter(page);  // read again after the screenshot: a run that overshot shows it here
    check(stepped.iteration === paused.iteration + STEPS && stepped.state === 'paused',
      `after pause at ${paused.iteration} and step ${STEPS} the page shows ${JSON.stringify(stepped)}`);
    await page.click('[data-test=resume]');
    await waitForCounter(page, { state: 'running', above: stepped.iteration }, 'running again');
    console.log(`paused at ${paused.iteration}, stepped to ${stepped.iteration}, resumed to ${(await counter(page)).iteration}`);
    await page.click('[data-test=stop]');
    await waitForCounter(page, { state: 'stopping' }, 'the stopping state');
  } catch (error) {
    await reportFailure(page);
    throw error;
  } finally {
    await browser.close();
    server.close();
  }
}

main().then(() => console.log('e2e training: passed'), (error) => {
  console.error(error.message);
  process.exit(1);
});
