// Shared by the end-to-end scenarios: Debian's Chromium driven by playwright-core, the built page served
// from dist/ on a loopback port when no backend serves it, screenshots, and checks that say what failed.
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const HERE = path.dirname(fileURLToPath(import.meta.url));
export const DIST = path.resolve(HERE, '..', 'dist');
const TYPES = { '.html': 'text/html', '.js': 'text/javascript', '.css': 'text/css', '.svg': 'image/svg+xml' };

export function check(condition, message) {
  if (!condition) throw new Error(`e2e: ${message}`);
}

export async function launch() {
  const executablePath = process.env.CHROMIUM || '/usr/bin/chromium';
  check(fs.existsSync(executablePath), `no Chromium at ${executablePath}: apt-get install -y chromium, or set CHROMIUM`);
  const browser = await chromium.launch({ executablePath, args: ['--no-sandbox'] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  page.on('pageerror', (error) => console.error(`page error: ${error.message}`));
  return { browser, page };
}

/** dist/ on a loopback port (training mode has no HTTP server of its own). */
export function serveDist() {
  check(fs.existsSync(path.join(DIST, 'index.html')), `no ${DIST}/index.html: run npm run build first`);
  const server = http.createServer((request, response) => {
    const relative = decodeURIComponent(new URL(request.url, 'http://x').pathname).replace(/^\/+/, '') || 'index.html';
    const file = path.join(DIST, relative);
    if (!file.startsWith(DIST) || !fs.existsSync(file) || fs.statSync(file).isDirectory()) {
      response.writeHead(404);
      response.end();
      return;
    }
    response.writeHead(200, { 'Content-Type': TYPES[path.extname(file)] || 'application/octet-stream' });
    fs.createReadStream(file).pipe(response);
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server)));
}

/** Where screenshots go: $MEGASCOPE_SCREENSHOTS (docs/images refreshes the README's), else e2e-artifacts/. */
export function screenshotDir() {
  const dir = path.resolve(process.env.MEGASCOPE_SCREENSHOTS || path.join(HERE, '..', 'e2e-artifacts'));
  fs.mkdirSync(dir, { recursive: true });
  return dir;
}

export async function screenshot(page, name) {
  const file = path.join(screenshotDir(), `megascope_${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  console.log(`screenshot ${file}`);
}

/** On a failure: what the page showed (its error frames, the connection detail) and a screenshot. */
export async function reportFailure(page) {
  const shown = await page.$$eval('[data-test=errors] .error, [data-test=detail]', (nodes) => nodes.map((n) => n.textContent.trim())).catch(() => []);
  if (shown.length) console.error(`the page shows:\n  ${shown.join('\n  ')}`);
  await screenshot(page, 'failure').catch(() => {});
}

/** Open the page with ?url=: it connects by itself (no click), as a link that names its backend should. */
export async function connect(page, pageUrl, wsUrl, mode) {
  await page.goto(`${pageUrl}?url=${encodeURIComponent(wsUrl)}`);
  await page.waitForSelector('[data-test=state]:text-is("connected")', { timeout: 60000 })
    .catch(() => { throw new Error(`e2e: the page opened with ?url=${wsUrl} did not connect by itself`); });
  check((await page.textContent('[data-test=protocol]')) === 'protocol v3', 'the page does not show protocol v3');
  check((await page.textContent('[data-test=mode]')) === mode, `the backend is not in ${mode} mode`);
}

/** The RGB of the cell (row, col) of a heatmap canvas, and the layout it was drawn with (HeatmapCanvas's data-layout). */
export function heatmapCell(page, selector, row, col) {
  return page.$eval(selector, (canvas, [r, c]) => {
    const layout = JSON.parse(canvas.dataset.layout);
    const ratio = canvas.width / canvas.clientWidth;
    const x = Math.floor((layout.left + (c + 0.5) * layout.cellW) * ratio);
    const y = Math.floor((layout.top + (r + 0.5) * layout.cellH) * ratio);
    return { rgb: Array.from(canvas.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3)), layout };
  }, [row, col]);
}

/** Canvas pixels that are not the white background, read from the canvas itself. */
export function paintedPixels(page, selector) {
  return page.$eval(selector, (canvas) => {
    const { data } = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height);
    let painted = 0;
    for (let i = 0; i < data.length; i += 4) if (data[i] < 250 || data[i + 1] < 250 || data[i + 2] < 250) painted += 1;
    return painted;
  });
}
