// Answer playback on the audio thread: a queue of PCM16 chunks at the server's output rate,
// converted to the AudioContext rate and played in order as they arrive.
//
// Messages from the main thread:
//   {type: 'audio', pcm: ArrayBuffer}  PCM16 LE mono at `srcRate` (append to the queue)
//   {type: 'flush'}                    barge-in: drop everything queued, now
// Messages to the main thread (every ~100 ms while playing, and at once on changes that matter):
//   {type: 'status', played, queued, flushed}  counts in AudioContext-rate samples;
//   `played` counts samples actually rendered from the queue, so it proves audio came out.
//
// The server sends audio paced in real time ~120 ms ahead of playout, so no jitter buffer is
// needed: we start playing as soon as a chunk arrives and play silence when the queue runs dry.

class Player extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.step = (opts.srcRate || 24000) / sampleRate;  // source samples per output sample
    this.queue = [];       // Float32Array chunks at sampleRate
    this.head = 0;         // read offset into queue[0]
    this.queued = 0;       // samples waiting
    this.played = 0;       // samples rendered from the queue, ever
    this.flushed = 0;      // samples dropped by flushes, ever
    this.blocks = 0;
    this.resetResampler();
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  resetResampler() {
    this.prev = 0;  // previous source sample
    this.pos = 0;   // read position in [prev, chunk...]
  }

  onMessage(msg) {
    if (msg.type === 'audio') {
      const out = this.resample(new Int16Array(msg.pcm));
      if (out.length) {
        this.queue.push(out);
        this.queued += out.length;
      }
    } else if (msg.type === 'flush') {
      this.flushed += this.queued;
      this.queue = [];
      this.head = 0;
      this.queued = 0;
      this.resetResampler();  // the next answer must not blend into the dropped one
      this.report();
    }
  }

  // Streaming linear interpolation from the source rate to sampleRate. Upsampling 24 kHz speech
  // this way is cheap and clean enough (the images sit above 12 kHz, where speech has little).
  resample(pcm) {
    const n = pcm.length;
    if (n === 0) return new Float32Array(0);
    const out = new Float32Array(Math.ceil((n - this.pos) / this.step) + 1);
    let k = 0;
    while (this.pos < n) {
      const i = Math.floor(this.pos);
      const a = i === 0 ? this.prev : pcm[i - 1] / 32768;
      const b = pcm[i] / 32768;
      out[k++] = a + (b - a) * (this.pos - i);
      this.pos += this.step;
    }
    this.pos -= n;
    this.prev = pcm[n - 1] / 32768;
    return out.subarray(0, k);
  }

  report() {
    this.port.postMessage({type: 'status', played: this.played, queued: this.queued, flushed: this.flushed});
  }

  process(inputs, outputs) {
    const out = outputs[0];
    const ch0 = out[0];
    const wasPlaying = this.queued > 0;
    let i = 0;
    while (i < ch0.length && this.queue.length) {
      const chunk = this.queue[0];
      const take = Math.min(ch0.length - i, chunk.length - this.head);
      ch0.set(chunk.subarray(this.head, this.head + take), i);
      i += take;
      this.head += take;
      if (this.head === chunk.length) {
        this.queue.shift();
        this.head = 0;
      }
    }
    // The rest of the block stays zero (silence) when the queue ran dry.
    this.played += i;
    this.queued -= i;
    for (let c = 1; c < out.length; c++) out[c].set(ch0);  // same sound on every channel
    // Report ~10x per second while playing, and at once when the queue just drained.
    if ((wasPlaying && this.queued === 0) || (i > 0 && ++this.blocks % 32 === 0)) this.report();
    return true;
  }
}

registerProcessor('player', Player);
