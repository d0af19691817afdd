// AudioWorklet processors for the voice demo. The page runs its AudioContext at 24 kHz,
// the gateway's PCM16 rate, so neither direction needs resampling here: the browser
// resamples the microphone into the context and the context out to the speakers.

const CAPTURE_FRAME = 480; // 20 ms at 24 kHz: small enough for snappy VAD upstream

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = new Int16Array(CAPTURE_FRAME);
    this.filled = 0;
    this.peak = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      const s = Math.max(-1, Math.min(1, channel[i]));
      this.peak = Math.max(this.peak, Math.abs(s));
      this.frame[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.filled === CAPTURE_FRAME) {
        this.port.postMessage({ pcm: this.frame.buffer, level: this.peak }, [this.frame.buffer]);
        this.frame = new Int16Array(CAPTURE_FRAME);
        this.filled = 0;
        this.peak = 0;
      }
    }
    return true;
  }
}

// Plays queued PCM with a small jitter buffer: playback starts once `prebufferSamples`
// are queued (or the response says no more is coming), so network jitter does not
// turn into clicks. `flush` drops everything at once (barge-in) and reports, per
// assistant item, how many samples were actually played so the page can truncate.
class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.queue = []; // [{item, samples: Float32Array, offset}]
    this.queued = 0;
    this.started = false;
    this.prebufferSamples = (options.processorOptions || {}).prebufferSamples || 2400;
    this.played = {}; // item id -> samples played
    this.totalPlayed = 0;
    this.ending = false;
    this.sinceReport = 0;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    if (msg.type === "chunk") {
      this.queue.push({ item: msg.item, samples: new Float32Array(msg.samples), offset: 0 });
      this.queued += msg.samples.byteLength / 4;
      this.ending = false;
    } else if (msg.type === "end") {
      this.ending = true;
    } else if (msg.type === "flush") {
      this.queue = [];
      this.queued = 0;
      this.started = false;
      this.port.postMessage({ type: "flushed", played: this.played, totalPlayed: this.totalPlayed });
    }
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    if (!this.started && (this.queued >= this.prebufferSamples || (this.ending && this.queued > 0))) {
      this.started = true;
    }
    let written = 0;
    while (this.started && written < out.length && this.queue.length) {
      const head = this.queue[0];
      const n = Math.min(out.length - written, head.samples.length - head.offset);
      out.set(head.samples.subarray(head.offset, head.offset + n), written);
      head.offset += n;
      written += n;
      this.queued -= n;
      this.played[head.item] = (this.played[head.item] || 0) + n;
      this.totalPlayed += n;
      if (head.offset === head.samples.length) this.queue.shift();
    }
    if (this.started && this.queue.length === 0) {
      this.started = false;
      if (this.ending) this.port.postMessage({ type: "drained", totalPlayed: this.totalPlayed });
      this.ending = false;
    }
    this.sinceReport += out.length;
    if (this.sinceReport >= 2400) {
      this.sinceReport = 0;
      this.port.postMessage({ type: "progress", totalPlayed: this.totalPlayed, queued: this.queued });
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
registerProcessor("playback-processor", PlaybackProcessor);
