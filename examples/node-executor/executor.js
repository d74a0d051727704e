#!/usr/bin/env node
// A durable executor in plain Node.js (no dependencies), written from proto/PROTOCOL.md and
// executor.proto alone: varint-delimited protobuf frames, encoded and decoded by hand.
// Kinds: demo.echo (output = input) and demo.sleep ({ms, steps}: one PROGRESS per slice).
'use strict';
const EXECUTOR_KIND = process.env.NODE_EXECUTOR_KIND || 'node';
const KINDS = ['demo.echo', 'demo.sleep'];
const MAX_FRAME_BYTES = 8 * 1024 * 1024; // the largest frame accepted on stdin (announced in the hello)

// --- protobuf: varints (wire type 0), length-delimited (2), doubles (1)
function varint(n) {
  const out = [];
  let v = BigInt.asUintN(64, BigInt(n)); // negative int32 = 10-byte two's complement
  do {
    let b = Number(v & 0x7fn);
    v >>= 7n;
    if (v) b |= 0x80;
    out.push(b);
  } while (v);
  return Buffer.from(out);
}
const key = (field, wire) => varint((field << 3) | wire);
const uint = (f, v) => (v ? Buffer.concat([key(f, 0), varint(v)]) : Buffer.alloc(0));
const bytes = (f, v) => { const b = Buffer.from(v); return Buffer.concat([key(f, 2), varint(b.length), b]); };
const str = (f, v) => (v ? bytes(f, v) : Buffer.alloc(0));
const double = (f, v) => { const b = Buffer.alloc(8); b.writeDoubleLE(v); return Buffer.concat([key(f, 1), b]); };

function readVarint(buf, pos) { // -> [value, next position], or null when buf ends first
  let v = 0n;
  for (let shift = 0n; pos < buf.length; shift += 7n) {
    const b = buf[pos++];
    v |= BigInt(b & 0x7f) << shift;
    if (!(b & 0x80)) return [v, pos];
  }
  return null;
}
function decode(buf) { // -> {field number: last value}; varints as BigInt, length-delimited as Buffer
  const msg = {};
  for (let pos = 0; pos < buf.length;) {
    const [k, p] = readVarint(buf, pos);
    const field = Number(k >> 3n), wire = Number(k & 7n);
    if (wire === 0) [msg[field], pos] = readVarint(buf, p);
    else if (wire === 2) { const [len, q] = readVarint(buf, p); pos = q + Number(len); msg[field] = buf.subarray(q, pos); }
    else if (wire === 1 || wire === 5) pos = p + (wire === 1 ? 8 : 4);
    else throw new Error(`unsupported wire type ${wire}`);
  }
  return msg;
}

// --- ExecutorFrame { hello = 1, event = 2, result = 3, error = 4 }; writes to a pipe are synchronous
function send(field, body) {
  const frame = bytes(field, body);
  process.stdout.write(Buffer.concat([varint(frame.length), frame]));
}
const jobs = new Map(); // job_id -> running job
let stdinClosed = false;

function event(job, kind, fraction) { // ProgressEvent: job_id 1, sequence 2, kind 3, fraction 5, at_unix_ms 7
  const f = fraction === undefined ? Buffer.alloc(0) : double(5, fraction);
  send(2, Buffer.concat([str(1, job.id), uint(2, ++job.seq), uint(3, kind), f, uint(7, Date.now())]));
}
const jobError = (job, code, message) =>
  Buffer.concat([str(1, job.id), uint(2, ++job.seq), str(3, code), str(4, message)]);
function finish(job, output, code, message) { // exactly one terminal per job
  if (job.done) return;
  job.done = true;
  clearTimeout(job.timer);
  jobs.delete(job.id);
  if (code) send(4, jobError(job, code, message));
  else {
    const result = Buffer.concat([str(1, job.id), uint(2, ++job.seq), bytes(3, JSON.stringify(output))]);
    const body = bytes(3, result); // the ExecutorFrame{result}: the supervisor's limit applies to it
    if (body.length > job.maxFrame) {
      --job.seq; // the error takes the result's sequence
      send(4, jobError(job, 'RESULT_TOO_LARGE', `result frame of ${body.length} bytes is over the supervisor's ${job.maxFrame}-byte limit`));
    } else send(3, result);
  }
  if (stdinClosed && jobs.size === 0) process.exit(0);
}

function onJob(j) { // Job: job_id 1, kind 6, input 11, max_frame_bytes 19 (protocol 1.1; absent: the default 8 MiB)
  const job = { id: String(j[1] || ''), seq: 0, done: false, maxFrame: Number(j[19] || 8 * 1024 * 1024) };
  const kind = String(j[6] || '');
  if (!KINDS.includes(kind)) { // a refusal: an error before ACCEPTED
    return send(4, Buffer.concat([str(1, job.id), str(3, 'UNSUPPORTED_KIND'), str(4, `no handler for ${kind}`)]));
  }
  jobs.set(job.id, job);
  job.cancel = () => finish(job, null, 'CANCELLED', 'cancelled on request');
  event(job, 1); // ACCEPTED, sequence 1
  let input;
  try { input = JSON.parse(String(j[11] || 'null')); } catch (e) { return finish(job, null, 'BAD_INPUT', e.message); }
  if (kind === 'demo.echo') return finish(job, input);
  const ms = Number(input?.ms ?? 1000), steps = Math.max(1, Number(input?.steps ?? 10));
  let slice = 0;
  const tick = () => {
    if (slice === steps) return finish(job, { slept_ms: ms });
    event(job, 3, ++slice / steps); // PROGRESS
    job.timer = setTimeout(tick, ms / steps);
  };
  job.timer = setTimeout(tick, ms / steps);
}

// --- SupervisorFrame { job = 1, cancel = 2 (job_id 1), shutdown = 3 } on stdin
let pending = Buffer.alloc(0);
process.stdin.on('data', (chunk) => {
  pending = Buffer.concat([pending, chunk]);
  for (let h; (h = readVarint(pending, 0)) && pending.length >= h[1] + Number(h[0]);) {
    const frame = decode(pending.subarray(h[1], h[1] + Number(h[0])));
    pending = pending.subarray(h[1] + Number(h[0]));
    if (frame[1]) onJob(decode(frame[1]));
    if (frame[2]) jobs.get(String(decode(frame[2])[1] || ''))?.cancel(); // unknown job: ignored
  }
});
process.stdin.on('end', () => { stdinClosed = true; if (jobs.size === 0) process.exit(0); });

// Hello: protocol_version 1, executor_kind 2, kinds 3, sdk_name 5, max_jobs_per_process 7 (-1: any), pid 8,
// and protocol 1.1's protocol_versions 9, features 10 (frame_limits: results respect Job.max_frame_bytes),
// max_frame_bytes 11
send(1, Buffer.concat([uint(1, 1), str(2, EXECUTOR_KIND), ...KINDS.map((k) => str(3, k)),
  str(5, 'node-example'), uint(7, -1), uint(8, process.pid),
  str(9, '1.0'), str(9, '1.1'), str(10, 'frame_limits'), uint(11, MAX_FRAME_BYTES)]));
