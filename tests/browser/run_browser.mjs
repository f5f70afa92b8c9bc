// Drives headless Chromium through one spoken turn of the web client; used by tests/test_browser.py.
//
//   node run_browser.mjs <url> <mic.wav> <out.json> <screenshot.png> [timeout_ms] [answers]
//
// Chromium's fake microphone plays <mic.wav> once (%noloop), then silence. We click Start, wait
// until `answers` (default 1) answers finished (response.done) *and* the audio of the last one
// was played out (the player queue is empty and no audio came for a while), then write what the
// page saw to <out.json>.
// The JSON is written even on timeout, so the Python test can show what happened.
import {chromium} from 'playwright-core';
import {mkdtempSync, rmSync, writeFileSync} from 'node:fs';
import {tmpdir} from 'node:os';
import {join, resolve} from 'node:path';

const [url, wav, outJson, shot, timeoutArg, answersArg] = process.argv.slice(2);
if (!url || !wav || !outJson || !shot) {
  console.error('usage: node run_browser.mjs <url> <mic.wav> <out.json> <screenshot.png> [timeout_ms]');
  process.exit(2);
}
const timeoutMs = Number(timeoutArg || 30000);
const answers = Number(answersArg || 1);
const profile = mkdtempSync(join(tmpdir(), 'duplex-chromium-'));  // a fresh profile every run

// The flags that work on this machine (see the platform notes): fake devices, no permission
// prompt, autoplay allowed, and nothing that reaches out to the network.
const args = [
  '--no-sandbox',
  '--use-fake-device-for-media-stream',
  '--use-fake-ui-for-media-stream',
  `--use-file-for-fake-audio-capture=${resolve(wav)}%noloop`,
  '--autoplay-policy=no-user-gesture-required',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--no-first-run',
  '--disable-gpu',
  '--disable-quic',
];

const console_ = [];
let result = {ok: false};
let context;
const t0 = Date.now();
try {
  context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args,
    viewport: {width: 1000, height: 760},
  });
  const page = context.pages()[0] || (await context.newPage());
  page.on('console', (m) => console_.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => console_.push(`pageerror: ${e.message}`));
  // Nothing outside the server may load: record any request to another origin.
  const origin = new URL(url).origin;
  const foreign = [];
  page.on('request', (r) => { if (!r.url().startsWith(origin)) foreign.push(r.url()); });

  await page.goto(url, {waitUntil: 'load'});
  await page.click('#start');
  let finished = true;
  try {
    await page.waitForFunction((answers) => {
      const t = window.duplexTest;
      const done = t.events.filter((e) => e.type === 'response.done').length >= answers;
      const quiet = performance.now() - t.lastAudioAt > 700;  // the paced audio stopped coming
      const failed = t.closes.length > 0 || t.errors.some((m) => m.startsWith('could not start'));
      return failed || (done && t.queuedSamples === 0 && quiet && t.playedSamples > 0) ||
        (done && t.audioFramesReceived === 0 && quiet);
    }, answers, {timeout: timeoutMs, polling: 100});
  } catch (e) {
    finished = false;
    console_.push(`driver: timed out after ${timeoutMs} ms waiting for the answer to play`);
  }
  await page.screenshot({path: shot, fullPage: true});
  const seen = await page.evaluate(() => {
    const t = window.duplexTest;
    return {
      events: t.events, closes: t.closes, errors: t.errors, status: t.status,
      contextRate: t.contextRate, sendRate: t.sendRate,
      micFramesSent: t.micFramesSent, micFramesDropped: t.micFramesDropped,
      audioFramesReceived: t.audioFramesReceived, playedSamples: t.playedSamples,
      playedSeconds: t.playedSeconds, queuedSamples: t.queuedSamples, flushedSamples: t.flushedSamples,
      transcriptText: t.transcriptText(), answerText: t.answerText(),
      latencyRows: document.querySelectorAll('#latency tbody tr').length,
      interruptedLines: document.querySelectorAll('#transcript .bot.interrupted').length,
      statusText: document.getElementById('status').textContent,
      errorBox: document.getElementById('errors').textContent,
    };
  });
  result = {ok: finished, elapsedMs: Date.now() - t0, foreignRequests: foreign, console: console_, ...seen};
} catch (e) {
  result = {ok: false, elapsedMs: Date.now() - t0, fatal: String(e && e.stack || e), console: console_};
} finally {
  writeFileSync(outJson, JSON.stringify(result, null, 1));
  await context?.close().catch(() => {});
  rmSync(profile, {recursive: true, force: true});
}
process.exit(result.ok ? 0 : 1);
