// End-to-end, training mode, against a real run (pretrain_gpt.py --training-ws-port): live iterations,
// pause / step 2 / resume move the iteration counter by exactly what was asked, then stop: the page shows
// the run as ended (the server's normal closure and its reason), not as a lost connection it retries. The
// run waits (--training-ws-wait) until the page resumes it.
//   MEGASCOPE_WS=ws://127.0.0.1:5002/ node e2e/training.mjs
import { check, connect, launch, reportFailure, screenshot, serveDist } from './browser.mjs';

const WS = process.env.MEGASCOPE_WS;
const STEPS = 2;
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

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

/** The control replies the page lists (training_state messages), oldest first. */
function controlLog(page) {
  return page.$$eval('[data-test=control-log] li', (items) => items.map((li) => ({ state: li.dataset.state, iteration: Number(li.dataset.iteration) })));
}

/** Wait for the page to list a control reply in `state` after the first `seen` ones (the list keeps the last six). */
async function nextControl(page, state, after) {
  await page.waitForFunction(([s, known]) => {
    const items = [...document.querySelectorAll('[data-test=control-log] li')].map((li) => `${li.dataset.state}@${li.dataset.iteration}`);
    return items.some((item) => item.startsWith(`${s}@`) && !known.includes(item));
  }, [state, after.map((e) => `${e.state}@${e.iteration}`)], { timeout: 120000 }).catch(() => { throw new Error(`e2e: timed out waiting for the "${state}" reply`); });
  const known = after.map((e) => `${e.state}@${e.iteration}`);
  return (await controlLog(page)).find((e) => e.state === state && !known.includes(`${e.state}@${e.iteration}`));
}

async function main() {
  check(WS, 'set MEGASCOPE_WS to the training run\'s --training-ws-port address');
  const server = await serveDist();
  const { browser, page } = await launch();
  try {
    await connect(page, `http://127.0.0.1:${server.address().port}/`, WS, 'training');
    // The run was started with --training-ws-wait: the page learns at once that it waits, and can start it.
    await waitForCounter(page, { state: 'paused', iteration: 0 }, 'the waiting run, paused before iteration 1');
    check(await page.isEnabled('[data-test=resume]') && await page.isEnabled('[data-test=step]'),
      'Resume and Step are not enabled for a run that waits for them');
    await page.click('[data-test=resume]');
    await waitForCounter(page, { state: 'running', above: 1 }, 'running iterations');
    await page.click('[data-test=watch-sample]');  // resid_post of sample 0, every iteration
    await page.waitForFunction(() => /\d/.test(document.querySelector('[data-test=sample-iteration]')?.textContent ?? ''), null, { timeout: 120000 });
    const first = (await counter(page)).iteration;
    await waitForCounter(page, { above: first + 4 }, 'a few iterations on the charts');
    const running = await controlLog(page);
    await page.click('[data-test=pause]');
    const paused = await nextControl(page, 'paused', running);
    await page.fill('[data-test=step-count]', String(STEPS));
    const before = await controlLog(page);
    await page.click('[data-test=step]');
    // The reply to step names the iteration the run was paused at (an iteration in flight at the pause
    // finished first); the run pauses again exactly STEPS iterations later.
    const started = await nextControl(page, 'running', before);
    const stopped = await nextControl(page, 'paused', [...before, started]);
    check(stopped.iteration === started.iteration + STEPS,
      `paused at ${paused.iteration}, step ${STEPS} started at ${started.iteration} and paused at ${stopped.iteration}`);
    await waitForCounter(page, { state: 'paused', iteration: stopped.iteration }, `the counter at ${stopped.iteration}, paused`);
    await screenshot(page, 'training');
    const shown = await counter(page);  // read again after the screenshot: a run that overshot shows it here
    check(shown.iteration === stopped.iteration && shown.state === 'paused', `after step ${STEPS} the page shows ${JSON.stringify(shown)}`);
    await page.click('[data-test=resume]');
    await waitForCounter(page, { state: 'running', above: shown.iteration }, 'running again');
    console.log(`paused (reply at ${paused.iteration}), stepped ${started.iteration} -> ${stopped.iteration}, resumed to ${(await counter(page)).iteration}`);
    await page.click('[data-test=stop]');
    await waitForCounter(page, { state: 'stopping' }, 'the stopping state');
    await page.waitForSelector('[data-test=training-ended]', { timeout: 120000 }).catch(async () => {
      throw new Error(`e2e: after Stop the page shows "${await page.textContent('[data-test=state]')}": ${await page.textContent('[data-test=detail]').catch(() => '')}`);
    });
    const ended = await page.textContent('[data-test=training-ended]');
    const bar = [await page.textContent('[data-test=state]'), await page.textContent('[data-test=training-state]')];
    check(/^training ended at iteration \d+/.test(ended) && same(bar, ['ended', 'ended']), `after Stop the page shows ${bar}: "${ended}"`);
    console.log(`the page shows: ${ended}`);
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
