// The browser client of the native protocol (docs/protocol.md): microphone -> WebSocket -> speaker.
//
// The mic streams all the time, also while the answer plays: the server does barge-in detection,
// so the client never gates the microphone. Audio runs on the audio thread in two AudioWorklets
// (mic-worklet.js, player-worklet.js); this file only moves buffers and draws the page.
'use strict';

const SUPPORTED_RATES = [8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000];
const MAX_WS_BUFFERED = 256 * 1024;  // bytes queued in the socket before we drop mic frames
const MAX_BACKLOG_FRAMES = 100;      // 2 s of mic audio kept while the socket connects
const CLOSE_REASONS = {
  1000: 'normal closure', 1001: 'server going away', 1006: 'connection lost (no close frame)',
  1008: 'policy: a limit was broken (see the error; e.g. output not read)', 1009: 'a frame was too large',
  1011: 'server error', 1013: 'server at capacity, try again later',
};
const LATENCY_KEYS = ['end_of_turn', 'final_transcript', 'first_llm_token', 'first_tts_chunk', 'first_audio'];

const $ = (id) => document.getElementById(id);

// Test hook for tests/test_browser.py: plain data the Playwright driver reads back.
const test = window.duplexTest = {
  events: [],            // every JSON event received, in order
  closes: [],            // {code, reason, meaning} for each WebSocket close
  errors: [],            // every message shown in the error box
  status: 'idle',
  contextRate: 0,        // AudioContext sample rate
  sendRate: 0,           // rate declared in session.start
  micFramesSent: 0,
  micFramesDropped: 0,
  audioFramesReceived: 0,
  lastAudioAt: 0,        // performance.now() of the last answer-audio frame
  playedSamples: 0,      // samples the player worklet actually rendered (AudioContext rate)
  playedSeconds: 0,
  queuedSamples: 0,
  flushedSamples: 0,     // samples dropped on barge-in
  transcriptText: () => textOf('#transcript .user'),
  answerText: () => textOf('#transcript .bot'),  // what was said: struck-through words left out
};

function textOf(selector) {
  return [...document.querySelectorAll(selector + ' .text')].map((e) =>
    [...e.childNodes].filter((n) => !n.classList?.contains('unplayed')).map((n) => n.textContent).join('')
  ).join(' ');
}

let sess = null;  // the running session: audio graph + socket + per-turn page elements

// -- page helpers ------------------------------------------------------------------------

function setStatus(name) {
  test.status = name;
  const el = $('status');
  el.textContent = name;
  el.className = 'status ' + name.replace(/ /g, '-');
}

function showError(msg) {
  test.errors.push(msg);
  const box = $('errors');
  const line = document.createElement('div');
  line.textContent = `${new Date().toLocaleTimeString()}  ${msg}`;
  box.append(line);
  while (box.children.length > 6) box.firstChild.remove();  // keep the page readable
  box.hidden = false;
}

function setButtons() {
  $('start').disabled = !!sess;
  $('stop').disabled = !sess;
  $('reconnect').disabled = !sess;
}

function line(cls, who) {
  const p = document.createElement('p');
  p.className = cls;
  p.innerHTML = `<span class="who">${who}</span><span class="text"></span>`;
  const box = $('transcript');
  box.querySelector('.hint')?.remove();
  box.append(p);
  return p;
}

function turnLines(s, turnId) {
  let t = s.turns.get(turnId);
  if (!t) s.turns.set(turnId, (t = {user: null, bot: null}));
  return t;
}

function scrollDown() {
  const box = $('transcript');
  box.scrollTop = box.scrollHeight;
}

function addLatencyRow(ev) {
  const row = document.createElement('tr');
  const cells = [`#${ev.turn_id}`, ...LATENCY_KEYS.map((k) => {
    const v = ev.stages?.[k];
    return typeof v === 'number' ? Math.round(v) : '–';
  })];
  for (const c of cells) {
    const td = document.createElement('td');
    td.textContent = c;
    row.append(td);
  }
  const first = ev.stages?.first_audio;
  const bar = document.createElement('td');
  bar.className = 'bar';
  if (typeof first === 'number') {
    const fill = document.createElement('div');
    fill.className = 'fill' + (first > 1500 ? ' slow' : '');
    fill.style.width = `${Math.max(0, Math.min(100, first / 30))}%`;  // 3 s = full width
    fill.title = `first audio ${Math.round(first)} ms after you stopped`;
    bar.append(fill);
  }
  row.append(bar);
  document.querySelector('#latency tbody').append(row);
}

// -- server events -----------------------------------------------------------------------

function onEvent(s, ev) {
  switch (ev.type) {
    case 'session.started':
      s.outRate = ev.output_sample_rate;
      if (s.modulesReady) makePlayer(s);  // else start() makes it once the worklets are loaded
      $('meta').textContent = `session ${ev.session_id} · profile ${ev.profile} · mic ${ev.input_sample_rate} Hz` +
        ` · answer ${ev.output_sample_rate} Hz · AudioContext ${s.ctx.sampleRate} Hz`;
      setStatus('listening');
      break;
    case 'speech.started':
      setStatus('user speaking');
      break;
    case 'transcript.partial': {
      const t = turnLines(s, ev.turn_id);
      t.user ??= line('user partial', 'you');
      t.user.querySelector('.text').textContent = ev.text;  // a partial replaces the last one
      scrollDown();
      break;
    }
    case 'speech.stopped':
      setStatus('thinking');
      break;
    case 'transcript.final': {
      const t = turnLines(s, ev.turn_id);
      if (!ev.text) {  // noise: no answer follows
        t.user?.remove();
        t.user = null;
        setStatus('listening');
        break;
      }
      t.user ??= line('user', 'you');
      t.user.className = 'user final';
      t.user.querySelector('.text').textContent = ev.text;
      scrollDown();
      break;
    }
    case 'response.started': {
      s.responseDone = false;
      const t = turnLines(s, ev.turn_id);
      t.bot = line('bot', 'bot');
      break;
    }
    case 'response.text.delta': {
      const t = turnLines(s, ev.turn_id);
      t.bot ??= line('bot', 'bot');
      t.bot.querySelector('.text').textContent += ev.delta;
      scrollDown();
      break;
    }
    case 'response.audio.started':
      setStatus('bot speaking');
      break;
    case 'turn.latency':
      addLatencyRow(ev);
      break;
    case 'response.interrupted': {
      s.player?.port.postMessage({type: 'flush'});  // stop the sound now, not when the queue ends
      const bot = turnLines(s, ev.turn_id).bot;
      if (bot) {
        // Show what was heard, and strike through what was generated but never played.
        const text = bot.querySelector('.text');
        const all = text.textContent;
        const heard = ev.played_text || '';
        text.textContent = all.startsWith(heard) ? heard : all;
        if (all.startsWith(heard) && all.length > heard.length) {
          const rest = document.createElement('span');
          rest.className = 'unplayed';
          rest.textContent = all.slice(heard.length);
          text.append(rest);
        }
        bot.classList.add('interrupted');
      }
      setStatus('interrupted');
      break;
    }
    case 'response.done': {
      s.responseDone = true;
      const bot = turnLines(s, ev.turn_id).bot;
      if (bot && !bot.querySelector('.text').textContent && ev.text) bot.querySelector('.text').textContent = ev.text;
      if (ev.status === 'failed') showError(`the answer to turn ${ev.turn_id} failed`);
      if (ev.status === 'cancelled') s.player?.port.postMessage({type: 'flush'});
      // 'bot speaking' lasts until the player drains (see makePlayer); unless nothing is queued.
      // After a barge-in the user is still talking: 'interrupted' stays until their turn ends.
      const talking = test.status === 'user speaking' || test.status === 'interrupted';
      if (!talking && (ev.status !== 'completed' || test.status !== 'bot speaking')) setStatus('listening');
      // The player may have drained before this event came: then nothing else would end 'bot speaking'.
      setTimeout(() => {
        if (test.status === 'bot speaking' && test.queuedSamples === 0) setStatus('listening');
      }, 300);
      break;
    }
    case 'error':
      showError(`server error ${ev.code}: ${ev.message}`);
      break;
  }
}

// -- audio -------------------------------------------------------------------------------

function makePlayer(s) {
  // A new session may announce a different output rate, so the player is made per session.
  s.player?.disconnect();
  s.player = new AudioWorkletNode(s.ctx, 'player', {
    numberOfInputs: 0, outputChannelCount: [1], processorOptions: {srcRate: s.outRate},
  });
  s.player.port.onmessage = (e) => {
    const m = e.data;
    test.playedSamples = m.played;
    test.playedSeconds = m.played / s.ctx.sampleRate;
    test.queuedSamples = m.queued;
    test.flushedSamples = m.flushed;
    if (m.queued === 0 && s.responseDone && test.status === 'bot speaking') setStatus('listening');
  };
  s.player.connect(s.ctx.destination);
}

function sendMic(s, buf) {
  const ws = s.ws;
  if (ws && ws.readyState === WebSocket.OPEN) {
    // If the network cannot keep up, drop audio rather than let latency grow without bound.
    if (ws.bufferedAmount > MAX_WS_BUFFERED) { test.micFramesDropped++; return; }
    ws.send(buf);
    test.micFramesSent++;
  } else if (!ws || ws.readyState === WebSocket.CONNECTING) {
    s.backlog.push(buf);  // the first words often come before the socket is open (or the secret)
    if (s.backlog.length > MAX_BACKLOG_FRAMES) { s.backlog.shift(); test.micFramesDropped++; }
  } else {
    test.micFramesDropped++;
  }
}

// -- connection --------------------------------------------------------------------------

// -- authentication ----------------------------------------------------------------------
//
// A server with API keys (/healthz says `auth: true`) needs one for every session, but a browser
// cannot set headers on a WebSocket. So the page trades the key for a short-lived, single-use
// client secret (POST /v1/realtime/client_secrets) and offers it as the subprotocol
// `duplex-secret.SECRET`: the key itself never travels on the WebSocket, and a secret that leaks
// from the page opens at most one session. A deployment's backend can mint the secret itself and
// open the page as `/#secret=ek_...` (docs/operations.md); otherwise the page asks for the key,
// which it keeps in sessionStorage for the next sessions of this tab.
const KEY_STORE = 'duplexApiKey';

async function sessionSecret() {
  const fromPage = new URLSearchParams(location.hash.slice(1)).get('secret');
  if (fromPage) {  // minted by the deployment's backend; single use, so forget it at once
    history.replaceState(null, '', location.pathname + location.search);
    test.secretFrom = 'page';
    return fromPage;
  }
  const health = await fetch('/healthz', {cache: 'no-store'}).then((r) => r.json()).catch(() => ({}));
  if (!health.auth) return null;
  const key = $('apikey').value.trim() || sessionStorage.getItem(KEY_STORE) || '';
  if (!key) {
    $('keyrow').hidden = false;
    throw new Error('this server needs an API key: enter it above, then press Reconnect');
  }
  const r = await fetch('/v1/realtime/client_secrets', {method: 'POST', headers: {Authorization: `Bearer ${key}`}});
  if (!r.ok) {
    sessionStorage.removeItem(KEY_STORE);
    $('keyrow').hidden = false;
    throw new Error(`the API key was refused (HTTP ${r.status})`);
  }
  sessionStorage.setItem(KEY_STORE, key);
  test.secretFrom = 'key';
  return (await r.json()).value;
}

async function connect(s) {
  let secret = null;
  try {
    secret = await sessionSecret();
  } catch (err) {
    showError(`could not connect: ${err.message}`);
    setStatus('disconnected');
    return;
  }
  if (s.closing || sess !== s) return;  // stopped while we asked for the secret
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  const protocols = secret ? ['duplex', `duplex-secret.${secret}`] : [];
  const ws = s.ws = new WebSocket(`${proto}//${location.host}/v1/duplex`, protocols);
  ws.binaryType = 'arraybuffer';
  $('conn').textContent = 'connecting…';
  ws.onopen = () => {
    $('conn').textContent = 'connected';
    ws.send(JSON.stringify({type: 'session.start', sample_rate: s.sendRate}));
    for (const buf of s.backlog.splice(0)) { ws.send(buf); test.micFramesSent++; }
  };
  ws.onmessage = (e) => {
    if (ws !== s.ws || s.closing) return;  // a socket we already replaced or stopped
    if (typeof e.data === 'string') {
      let ev;
      try { ev = JSON.parse(e.data); } catch { showError('bad JSON from server'); return; }
      test.events.push(ev);
      onEvent(s, ev);
    } else {
      test.audioFramesReceived++;
      test.lastAudioAt = performance.now();
      s.player?.port.postMessage({type: 'audio', pcm: e.data}, [e.data]);
    }
  };
  ws.onclose = (e) => {
    const meaning = CLOSE_REASONS[e.code] || 'unknown';
    test.closes.push({code: e.code, reason: e.reason, meaning});
    if (ws !== s.ws) return;
    s.player?.port.postMessage({type: 'flush'});
    $('conn').textContent = `closed: ${e.code} ${meaning}${e.reason ? ' — ' + e.reason : ''}`;
    if (!s.closing) {
      showError(`connection closed: code ${e.code} (${meaning})${e.reason ? ': ' + e.reason : ''}. Press Reconnect.`);
      setStatus('disconnected');
    }
  };
  // onerror carries no detail in browsers; onclose follows with the code, which we show.
}

async function start() {
  if (sess) return;
  $('errors').replaceChildren();
  $('errors').hidden = true;
  const s = sess = {turns: new Map(), backlog: [], closing: false};
  setButtons();
  setStatus('starting');
  try {
    if (!navigator.mediaDevices?.getUserMedia) {
      throw new Error('no microphone access: the page must be served over https or from localhost');
    }
    // Created in the click handler: autoplay policy lets only a user gesture start audio output.
    s.ctx = new AudioContext({latencyHint: 'interactive'});
    test.contextRate = s.ctx.sampleRate;
    // Send at the context rate when the server accepts it (it resamples properly); else 48 kHz.
    s.sendRate = SUPPORTED_RATES.includes(s.ctx.sampleRate) ? s.ctx.sampleRate : 48000;
    test.sendRate = s.sendRate;
    connect(s);  // in parallel with the mic permission prompt; early mic frames are kept
    const [stream] = await Promise.all([
      navigator.mediaDevices.getUserMedia({
        audio: {echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1},
      }),
      s.ctx.audioWorklet.addModule('mic-worklet.js'),
      s.ctx.audioWorklet.addModule('player-worklet.js'),
    ]);
    s.stream = stream;
    if (s.closing) { stream.getTracks().forEach((t) => t.stop()); return; }  // Stop pressed meanwhile
    s.modulesReady = true;
    if (s.outRate) makePlayer(s);  // session.started came before the worklets loaded
    s.source = s.ctx.createMediaStreamSource(stream);
    s.mic = new AudioWorkletNode(s.ctx, 'mic-capture', {processorOptions: {targetRate: s.sendRate}});
    s.mic.port.onmessage = (e) => sendMic(s, e.data);
    s.source.connect(s.mic);
    // The mic node outputs silence; connecting it makes sure the graph pulls it every block.
    s.mic.connect(s.ctx.destination);
    await s.ctx.resume();
  } catch (err) {
    showError(`could not start: ${err.name ? err.name + ': ' : ''}${err.message}`);
    stop(s);
  }
}

function stop(s = sess) {
  if (!s || s.closing) return;
  s.closing = true;
  if (sess === s) sess = null;
  s.ws?.close(1000, 'client stopped');
  s.stream?.getTracks().forEach((t) => t.stop());
  s.ctx?.close();
  setButtons();
  setStatus('idle');
}

function reconnect() {
  // A new session on a new socket; the microphone and audio graph stay as they are.
  const s = sess;
  if (!s) return;
  const old = s.ws;
  s.ws = null;
  old?.close(1000, 'client reconnecting');
  s.player?.port.postMessage({type: 'flush'});
  s.responseDone = false;
  s.backlog = [];
  s.turns = new Map();  // the new session counts turns from 1 again; keep the old lines as they are
  $('errors').replaceChildren();  // the error that made the user reconnect is now stale
  $('errors').hidden = true;
  connect(s);
}

window.addEventListener('error', (e) => showError(`page error: ${e.message}`));
window.addEventListener('unhandledrejection', (e) => showError(`page error: ${e.reason}`));
$('start').addEventListener('click', () => start());
$('stop').addEventListener('click', () => stop());
$('reconnect').addEventListener('click', () => reconnect());
setButtons();
