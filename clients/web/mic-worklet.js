// Microphone capture on the audio thread: mono PCM16 frames of 20 ms, posted to the main thread.
//
// The audio thread hands us 128-sample blocks; sending one WebSocket message per block (2.7 ms)
// would be wasteful, so we batch them into 20 ms frames (the protocol's typical size).
// If the AudioContext runs at a rate the server does not accept, we resample here (linear
// interpolation) to `targetRate`; otherwise targetRate == sampleRate and samples pass through
// untouched, and the server's proper resampler does the work.

class MicCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.targetRate = opts.targetRate || sampleRate;  // `sampleRate` is the AudioContext's rate
    this.step = sampleRate / this.targetRate;         // input samples per output sample
    this.frameLen = Math.round(this.targetRate / 50);  // 20 ms
    this.frame = new Int16Array(this.frameLen);
    this.fill = 0;
    // Linear resampler state: the previous input sample and the read position relative to it.
    this.prev = 0;
    this.pos = 0;
  }

  push(x) {
    const s = Math.max(-1, Math.min(1, x));
    this.frame[this.fill++] = s < 0 ? s * 0x8000 : s * 0x7fff;
    if (this.fill === this.frameLen) {
      // Transfer the buffer (no copy) and start a fresh one.
      this.port.postMessage(this.frame.buffer, [this.frame.buffer]);
      this.frame = new Int16Array(this.frameLen);
      this.fill = 0;
    }
  }

  process(inputs) {
    const input = inputs[0];
    if (!input || input.length === 0) return true;  // mic not connected yet: keep the node alive
    const n = input[0].length;
    // Mix all channels down to mono (the fake device and some USB mics are stereo).
    const mono = new Float32Array(n);
    for (const ch of input) for (let i = 0; i < n; i++) mono[i] += ch[i] / input.length;

    if (this.step === 1) {
      for (let i = 0; i < n; i++) this.push(mono[i]);
    } else {
      // Virtual sequence [prev, mono[0], ..., mono[n-1]]; read at pos, pos+step, ...
      while (this.pos < n) {
        const i = Math.floor(this.pos);
        const frac = this.pos - i;
        const a = i === 0 ? this.prev : mono[i - 1];
        this.push(a + (mono[i] - a) * frac);
        this.pos += this.step;
      }
      this.pos -= n;
      this.prev = mono[n - 1];
    }
    return true;
  }
}

registerProcessor('mic-capture', MicCapture);
