// Open a merged MegaScan trace in a real, offline Perfetto UI (headless Chromium) and print what a user
// sees: the track list in display order, and how many flows the UI kept of those in the file.
// Set-up and use: docs/megascan_aggregate.md ("Checking the trace in the Perfetto UI").
//
//   node scripts/perfetto_ui_check.js WEB_DIST TRACE.json [SCREENSHOT.png]
//
// WEB_DIST is a folder holding a built Perfetto UI (its index.html); playwright-core must be installed
// (npm) and Chromium be at $CHROMIUM (default /usr/bin/chromium).
const fs = require('fs');
const http = require('http');
const path = require('path');
const { chromium } = require('playwright-core');

const TYPES = { '.html': 'text/html', '.js': 'text/javascript', '.css': 'text/css', '.wasm': 'application/wasm',
                '.json': 'application/json', '.png': 'image/png', '.woff2': 'font/woff2' };

function serve(root) {  // the UI's files on a loopback port: the UI cannot run from file:// URLs
  const server = http.createServer((request, response) => {
    const file = path.join(root, decodeURIComponent(request.url.split('?')[0]));
    const target = fs.existsSync(file) && fs.statSync(file).isDirectory() ? path.join(file, 'index.html') : file;
    if (!target.startsWith(root) || !fs.existsSync(target)) { response.writeHead(404); response.end(); return; }
    response.writeHead(200, { 'Content-Type': TYPES[path.extname(target)] || 'application/octet-stream' });
    fs.createReadStream(target).pipe(response);
  });
  return new Promise(resolve => server.listen(0, '127.0.0.1', () => resolve(server)));
}

(async () => {
  const [webDist, trace, screenshot] = process.argv.slice(2);
  const server = await serve(path.resolve(webDist));
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
                                          args: ['--no-sandbox'] });
  try {
    const page = await browser.newPage({ viewport: { width: 1600, height: 2400 } });
    await page.goto(`http://127.0.0.1:${server.address().port}/`);
    await page.waitForSelector('input[type=file]', { state: 'attached', timeout: 60000 });
    await (await page.$$('input[type=file]'))[0].setInputFiles(trace);
    await page.waitForSelector('.pf-track__title', { timeout: 120000 });
    await page.keyboard.press('Escape');  // a dialog about a fetch that has no network to reach, if any
    for (const button of await page.$$('.pf-track__header--summary .pf-track__collapse-button')) {
      if ((await button.innerText()).includes('expand_more')) await button.click();  // expand the groups
    }
    const tracks = await page.evaluate(() => [...document.querySelectorAll('.pf-track')].map(track => {
      const title = track.querySelector('.pf-track__title-popup') || track.querySelector('.pf-track__title');
      const summary = track.querySelector('.pf-track__header--summary') !== null;
      return (summary ? '' : '  ') + (title ? title.textContent.trim() : '?');
    }));
    console.log(tracks.join('\n'));
    const flows = await page.evaluate(async () =>
      (await globalThis.app.trace.engine.query('select count(*) as n from flow')).firstRow({ n: 0 }).n);
    const written = JSON.parse(fs.readFileSync(trace)).traceEvents.filter(e => e.ph === 's').length;
    console.log(`flows: ${flows} shown of ${written} in the file`);
    if (screenshot) await page.screenshot({ path: screenshot });
  } finally {
    await browser.close();
    server.close();
  }
})();
