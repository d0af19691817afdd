// duplex-gateway voice demo: the OpenAI Realtime protocol (GA shape) over WebRTC by
// default, as OpenAI's WebRTC guide does it: the microphone and the answer as Opus
// tracks with the browser's echo canceller and jitter buffer, events on the
// "oai-events" data channel, the gateway truncating on barge-in. Or over one WebSocket
// (the "over" menu, ?transport=websocket): microphone in through an AudioWorklet,
// speech out through another, the page truncating what it did not play.
// The user's words show as live captions while they speak (input transcription deltas),
// then as the completed transcript. "Captions only" opens a transcription session
// (?intent=transcription): the same captions, and nothing answers.

const RATE = 24000;
const $ = (id) => document.getElementById(id);

// Everything a test (or a curious user in the console) may want to read.
const demo = {
  state: "disconnected",
  samplesPlayed: 0,
  samplesReceived: 0,
  micPeak: 0,
  staleChunks: 0,
  responses: [], // final status of every response, in order
  truncatesSent: [],
  userTranscripts: [],
  captions: {}, // item id -> the caption shown so far (deltas, then the transcript)
  captionsAtSpeechStopped: [], // the caption of each item when its speech_stopped came
  sessionType: null,
  assistantTexts: [],
  errors: [],
  latencyMs: [],
  eventCounts: {},
  toolCalls: [], // {name, arguments, output} of every call the page answered
  transport: null, // "webrtc" or "websocket", once connecting
  truncated: [], // conversation.item.truncated events (WebRTC: the gateway cut the answer)
  receiveBufferMs: [], // WebRTC: the browser's jitter buffer delay, after each response
  receiveJitterMs: [], // ...and the packets' arrival jitter then
};
window.duplexDemo = demo;

let ws = null;
let pc = null; // the WebRTC call, when connected over WebRTC
let dc = null; // its "oai-events" data channel
let remoteAudio = null;
let audioCtx = null;
let micStream = null;
let captureNode = null;
let playbackNode = null;
let session = null;
let speechStoppedAt = null;
let awaitingFirstAudio = false;
let playingItem = null; // assistant item whose audio is queued or playing
const bubbles = new Map(); // item id -> element
const answeredResponses = new Set(); // responses whose calls the page answered

// The page's one built-in tool: it runs here, in the browser, not on the server.
const LOCAL_TIME_TOOL = {
  type: "function",
  name: "get_local_time",
  description: "The current local date and time of the user",
  parameters: { type: "object", properties: {}, additionalProperties: false },
};

function runTool(name) {
  if (name !== LOCAL_TIME_TOOL.name) return JSON.stringify({ error: `unknown tool ${name}` });
  const now = new Date();
  return JSON.stringify({ time: now.toLocaleTimeString(), date: now.toLocaleDateString() });
}

// A finished call: run it, show it, and send its result; the answer is asked for once
// the calling response is done (only one response may be active).
function answerCall(e) {
  const output = runTool(e.name);
  demo.toolCalls.push({ name: e.name, arguments: e.arguments, output });
  setBubbleText(e.item_id, "tool", `${e.name}(${e.arguments}) → ${output}`);
  send({ type: "conversation.item.create", item: { type: "function_call_output", call_id: e.call_id, output } });
  answeredResponses.add(e.response_id);
}
const flushedItems = new Set(); // assistant items cut off by barge-in

function setState(state, detail = "") {
  demo.state = state;
  $("state").textContent = detail ? `${state}: ${detail}` : state;
  $("state").dataset.state = state;
  $("connect").textContent = state === "disconnected" ? "Connect" : "Disconnect";
  for (const el of document.querySelectorAll("[data-needs-connection]")) {
    el.disabled = state === "disconnected" || state === "connecting";
  }
}

function showError(message) {
  demo.errors.push(message);
  const el = $("error");
  el.textContent = message;
  el.hidden = false;
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
  if (dc && dc.readyState === "open") dc.send(JSON.stringify(event));
}

function bubble(itemId, role) {
  let el = bubbles.get(itemId);
  if (!el) {
    el = document.createElement("div");
    el.className = `bubble ${role}`;
    el.dataset.item = itemId;
    el.innerHTML = `<span class="who"></span><span class="text"></span>`;
    el.querySelector(".who").textContent = { user: "You", tool: "Tool call" }[role] || "Assistant";
    $("log").appendChild(el);
    bubbles.set(itemId, el);
  }
  return el;
}

function setBubbleText(itemId, role, text, append = false) {
  const el = bubble(itemId, role).querySelector(".text");
  el.textContent = append ? el.textContent + text : text;
  $("log").scrollTop = $("log").scrollHeight;
  return el.textContent;
}

// ---- audio ------------------------------------------------------------------

async function startAudio() {
  audioCtx = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
  await audioCtx.audioWorklet.addModule("worklets.js");
  playbackNode = new AudioWorkletNode(audioCtx, "playback-processor", {
    outputChannelCount: [1],
    processorOptions: { prebufferSamples: RATE / 10 },
  });
  playbackNode.port.onmessage = (event) => onPlaybackMessage(event.data);
  playbackNode.connect(audioCtx.destination);
  try {
    micStream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (err) {
    showError(`Microphone unavailable (${err.name}); you can still type.`);
    return;
  }
  const source = audioCtx.createMediaStreamSource(micStream);
  captureNode = new AudioWorkletNode(audioCtx, "capture-processor");
  captureNode.port.onmessage = (event) => onCapturedFrame(event.data);
  source.connect(captureNode);
}

function stopAudio() {
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (remoteAudio) remoteAudio.srcObject = null;
  if (audioCtx) audioCtx.close();
  micStream = audioCtx = captureNode = playbackNode = null;
}

function onCapturedFrame({ pcm, level }) {
  $("level").value = level;
  demo.micPeak = Math.max(demo.micPeak, level);
  if ($("mute").checked) return;
  send({ type: "input_audio_buffer.append", audio: bytesToBase64(new Uint8Array(pcm)) });
}

function onPlaybackMessage(msg) {
  if (msg.type === "progress" || msg.type === "drained") {
    demo.samplesPlayed = msg.totalPlayed;
    $("played").textContent = (msg.totalPlayed / RATE).toFixed(1);
    if (msg.type === "drained") playingItem = null; // the whole answer was heard
  } else if (msg.type === "flushed") {
    demo.samplesPlayed = msg.totalPlayed;
    onFlushed(msg.played);
  }
}

function playPcm16(itemId, base64) {
  if (flushedItems.has(itemId)) {
    demo.staleChunks += 1; // audio of an interrupted answer: never played
    return;
  }
  const bytes = base64ToBytes(base64);
  const pcm = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >> 1);
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 0x8000;
  demo.samplesReceived += samples.length;
  playingItem = itemId;
  if (playbackNode) playbackNode.port.postMessage({ type: "chunk", item: itemId, samples: samples.buffer }, [samples.buffer]);
}

// Barge-in: drop queued speech at once, then tell the server how much was heard so
// the assistant's transcript (and the model's memory of it) is cut to match. Over
// WebRTC the gateway plays the audio, so it cuts and truncates by itself on speech;
// a typed message asks it to with output_audio_buffer.clear.
function interruptPlayback(typed = false) {
  if (pc && typed) send({ type: "output_audio_buffer.clear" });
  if (!playbackNode || !playingItem) return;
  playbackNode.port.postMessage({ type: "flush" });
}

function onFlushed(playedByItem) {
  const itemId = playingItem;
  playingItem = null;
  if (!itemId) return;
  flushedItems.add(itemId);
  const audioEndMs = Math.floor(((playedByItem[itemId] || 0) / RATE) * 1000);
  const event = { type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: audioEndMs };
  demo.truncatesSent.push(event);
  send(event);
  const el = bubbles.get(itemId);
  if (el) el.classList.add("interrupted");
}

// ---- protocol ---------------------------------------------------------------

// The gateway names the model it serves on /healthz (which needs no key).
async function servedModel(params) {
  if (params.get("model")) return params.get("model");
  const health = await fetch("/healthz").then((r) => r.json());
  return health.model;
}

function chosenTransport(params) {
  if ($("captionsOnly").checked || params.get("intent") === "transcription") return "websocket";
  return params.get("transport") || $("transport").value;
}

async function connect() {
  const params = new URLSearchParams(location.search);
  setState("connecting");
  demo.transport = chosenTransport(params);
  if (demo.transport === "webrtc") return connectWebRTC(params);
  let model;
  try {
    model = await servedModel(params);
  } catch (err) {
    setState("disconnected");
    showError(`Gateway unreachable: ${err.message}`);
    return;
  }
  let url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime?model=${encodeURIComponent(model)}`;
  if ($("captionsOnly").checked || params.get("intent") === "transcription") url += "&intent=transcription";
  const key = $("apiKey").value.trim() || params.get("api_key") || "";
  const protocols = ["realtime"];
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  $("error").hidden = true;
  ws = new WebSocket(url, protocols);
  ws.onopen = async () => {
    setState("connected");
    try {
      await startAudio();
    } catch (err) {
      showError(`Audio failed to start: ${err.message}`);
    }
  };
  ws.onmessage = (event) => onServerEvent(JSON.parse(event.data));
  ws.onerror = () => showError("Connection error: is the gateway running?");
  ws.onclose = (event) => {
    stopAudio();
    setState("disconnected", event.reason || (event.code !== 1000 ? `closed (${event.code})` : ""));
    ws = null;
  };
}

// OpenAI's WebRTC guide, with the real key (when the gateway has one) in place of an
// ephemeral one: this page is served by the gateway itself.
async function connectWebRTC(params) {
  const key = $("apiKey").value.trim() || params.get("api_key") || "";
  $("error").hidden = true;
  try {
    pc = new RTCPeerConnection();
    remoteAudio = document.createElement("audio");
    remoteAudio.autoplay = true;
    pc.ontrack = (e) => (remoteAudio.srcObject = e.streams[0]);
    pc.onconnectionstatechange = () => {
      if (pc && ["failed", "closed"].includes(pc.connectionState)) disconnect(`call ${pc.connectionState}`);
    };
    micStream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    pc.addTrack(micStream.getTracks()[0]);
    dc = pc.createDataChannel("oai-events");
    dc.onopen = () => setState("connected");
    dc.onmessage = (event) => onServerEvent(JSON.parse(event.data));
    dc.onclose = () => disconnect();
    const offer = await pc.createOffer();
    await pc.setLocalDescription(offer);
    const headers = { "Content-Type": "application/sdp" };
    if (key) headers.Authorization = `Bearer ${key}`;
    const answer = await fetch("/v1/realtime/calls", { method: "POST", body: offer.sdp, headers });
    if (answer.status !== 201) {
      const body = await answer.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${answer.status}`);
    }
    await pc.setRemoteDescription({ type: "answer", sdp: await answer.text() });
  } catch (err) {
    showError(`WebRTC call failed: ${err.message}`);
    disconnect();
  }
}

function disconnect(reason = "") {
  if (ws) ws.close(1000, "user disconnected");
  if (pc) {
    const call = pc;
    pc = dc = null;
    call.close();
    stopAudio();
    setState("disconnected", reason);
  }
}

const handlers = {
  "session.created": (e) => {
    showSession(e.session);
    // Ask for the user's words too, so the page can show what it heard.
    $("transcribe").checked = true;
    applySettings();
  },
  "session.updated": (e) => showSession(e.session),
  "input_audio_buffer.speech_started": (e) => {
    setState("connected", "listening");
    bubble(e.item_id, "user").classList.add("live");
    interruptPlayback();
  },
  "input_audio_buffer.speech_stopped": (e) => {
    demo.captionsAtSpeechStopped.push(demo.captions[e.item_id] || "");
    if (demo.sessionType === "transcription") {
      setState("connected", "transcribing");
      return;
    }
    speechStoppedAt = performance.now();
    awaitingFirstAudio = true;
    setState("connected", "thinking");
  },
  // Live captions: each delta adds the words heard so far; the completed transcript
  // replaces them (they are the same words, now final).
  "conversation.item.input_audio_transcription.delta": (e) => {
    demo.captions[e.item_id] = setBubbleText(e.item_id, "user", e.delta, true);
    bubble(e.item_id, "user").classList.add("live");
  },
  "conversation.item.input_audio_transcription.completed": (e) => {
    demo.userTranscripts.push(e.transcript);
    demo.captions[e.item_id] = setBubbleText(e.item_id, "user", e.transcript);
    bubble(e.item_id, "user").classList.remove("live");
    if (demo.sessionType === "transcription") setState("connected", "listening");
  },
  "conversation.item.input_audio_transcription.failed": (e) => showError(`Transcription failed: ${e.error.message}`),
  "conversation.item.added": (e) => {
    const item = e.item;
    if (item.type !== "message" || item.role !== "user") return;
    const typed = (item.content || []).find((c) => c.type === "input_text");
    if (typed) setBubbleText(item.id, "user", typed.text);
  },
  "response.created": () => setState("connected", "thinking"),
  "response.output_item.added": (e) => bubble(e.item.id, e.item.type === "function_call" ? "tool" : "assistant"),
  "response.function_call_arguments.delta": (e) => setBubbleText(e.item_id, "tool", e.delta, true),
  "response.function_call_arguments.done": answerCall,
  "response.output_audio_transcript.delta": (e) => setBubbleText(e.item_id, "assistant", e.delta, true),
  "response.output_text.delta": (e) => setBubbleText(e.item_id, "assistant", e.delta, true),
  "response.output_audio_transcript.done": (e) => demo.assistantTexts.push(e.transcript),
  "response.output_text.done": (e) => demo.assistantTexts.push(e.text),
  "response.output_audio.delta": (e) => {
    if (demo.state !== "connected" || $("state").textContent !== "connected: speaking") setState("connected", "speaking");
    if (awaitingFirstAudio && speechStoppedAt !== null) {
      const ms = Math.round(performance.now() - speechStoppedAt);
      demo.latencyMs.push(ms);
      $("latency").textContent = `${ms} ms`;
      awaitingFirstAudio = false;
    }
    playPcm16(e.item_id, e.delta);
  },
  "response.output_audio.done": () => playbackNode && playbackNode.port.postMessage({ type: "end" }),
  // WebRTC: the answer plays on the call's track; the gateway reports it.
  "output_audio_buffer.started": () => {
    setState("connected", "speaking");
    if (awaitingFirstAudio && speechStoppedAt !== null) {
      const ms = Math.round(performance.now() - speechStoppedAt);
      demo.latencyMs.push(ms);
      $("latency").textContent = `${ms} ms`;
      awaitingFirstAudio = false;
    }
  },
  "conversation.item.truncated": (e) => {
    demo.truncated.push(e);
    const el = bubbles.get(e.item_id);
    if (el) el.classList.add("interrupted");
  },
  "response.done": (e) => {
    const r = e.response;
    demo.responses.push(r.status);
    if (pc) showReceiveBuffer();
    if (answeredResponses.delete(r.id) && r.status === "completed") {
      // The answer that uses the result; it may not call again.
      send({ type: "response.create", response: { tool_choice: "none" } });
    }
    if (r.status === "failed") showError(`Response failed: ${(r.status_details && r.status_details.error && r.status_details.error.message) || "unknown error"}`);
    setState("connected", r.status === "cancelled" ? "interrupted" : "ready");
  },
  error: (e) => showError(`${e.error.code || e.error.type}: ${e.error.message}`),
};

// Over WebRTC the answer waits in the browser's jitter buffer before it plays: the
// average delay per sample so far, from the call's inbound audio statistics.
async function showReceiveBuffer() {
  const stats = await pc.getStats();
  for (const s of stats.values()) {
    if (s.type !== "inbound-rtp" || s.kind !== "audio" || !s.jitterBufferEmittedCount) continue;
    const ms = Math.round((s.jitterBufferDelay / s.jitterBufferEmittedCount) * 1000);
    demo.receiveBufferMs.push(ms);
    demo.receiveJitterMs.push(Math.round(s.jitter * 1000)); // arrival jitter, as RTP counts it
    $("receiveBuffer").textContent = `${ms} ms`;
    $("receiveBuffer").parentElement.hidden = false;
  }
}

function onServerEvent(event) {
  demo.eventCounts[event.type] = (demo.eventCounts[event.type] || 0) + 1;
  const handler = handlers[event.type];
  if (handler) handler(event);
}

function showSession(s) {
  session = s;
  demo.sessionType = s.type;
  // A transcription session has no answers to shape: only its input settings apply.
  const transcribing = s.type === "transcription";
  for (const id of ["instructions", "voice", "tools"]) $(id).closest("label").hidden = transcribing;
  $("composer").hidden = transcribing;
  $("instructions").value = s.instructions || "";
  const out = (s.audio && s.audio.output) || {};
  $("voice").value = out.voice || "";
  const td = s.audio && s.audio.input && s.audio.input.turn_detection;
  $("turnDetection").value = td ? td.type : "none";
  $("transcribe").checked = Boolean(s.audio && s.audio.input && s.audio.input.transcription);
  if (td && td.threshold !== undefined) $("threshold").value = td.threshold;
  if (td && td.silence_duration_ms !== undefined) $("silence").value = td.silence_duration_ms;
  if (td && td.eagerness !== undefined) $("eagerness").value = td.eagerness;
  $("commit").hidden = Boolean(td);
  const choice = (s.tools || []).length ? s.tool_choice : "off";
  $("tools").value = typeof choice === "string" ? choice : "required";
  showModeFields();
}

// Each turn-detection mode shows only the fields it takes.
function showModeFields() {
  const mode = $("turnDetection").value;
  for (const label of document.querySelectorAll("label[data-for]")) label.hidden = label.dataset.for !== mode;
}

function applySettings(event) {
  if (event) event.preventDefault();
  const mode = $("turnDetection").value;
  const turnDetection = mode === "none" ? null
    : mode === "semantic_vad" ? { type: mode, eagerness: $("eagerness").value }
    : { type: mode, threshold: Number($("threshold").value), silence_duration_ms: Number($("silence").value) };
  const transcription = $("transcribe").checked ? { model: "whisper-1", language: "en" } : null;
  if (demo.sessionType === "transcription") {
    // Input settings only: its turn detection commits speech, and nothing answers.
    send({ type: "session.update", session: { type: "transcription", audio: { input: { turn_detection: turnDetection, transcription } } } });
    return;
  }
  const update = {
    type: "realtime",
    instructions: $("instructions").value,
    audio: { input: { turn_detection: turnDetection, transcription } },
  };
  const voice = $("voice").value.trim();
  if (voice) update.audio.output = { voice };
  const tools = $("tools").value;
  update.tools = tools === "off" ? [] : [LOCAL_TIME_TOOL];
  update.tool_choice = tools === "off" ? "auto" : tools;
  send({ type: "session.update", session: update });
}

function sendText(event) {
  event.preventDefault();
  const text = $("text").value.trim();
  if (!text) return;
  interruptPlayback(true);
  send({ type: "conversation.item.create", item: { type: "message", role: "user", content: [{ type: "input_text", text }] } });
  send({ type: "response.create" });
  $("text").value = "";
}

function commitAudio() {
  send({ type: "input_audio_buffer.commit" });
  if (demo.sessionType === "transcription") return; // transcribed, never answered
  speechStoppedAt = performance.now();
  awaitingFirstAudio = true;
  send({ type: "response.create" });
}

// ---- helpers ----------------------------------------------------------------

function bytesToBase64(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function base64ToBytes(b64) {
  const binary = atob(b64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

$("connect").addEventListener("click", () => (ws || pc ? disconnect() : connect()));
$("mute").addEventListener("change", () => {
  if (pc && micStream) micStream.getTracks().forEach((t) => (t.enabled = !$("mute").checked));
});
const chosen = new URLSearchParams(location.search).get("transport");
if (chosen) $("transport").value = chosen;
$("settings").addEventListener("submit", applySettings);
$("composer").addEventListener("submit", sendText);
$("commit").addEventListener("click", commitAudio);
setState("disconnected");
$("turnDetection").addEventListener("change", showModeFields);
showModeFields();
