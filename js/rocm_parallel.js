// ROCm Parallel: the worker group's live state, drawn under every ROCm Parallel Loader node. The layout
// line is the resident layout's degrees as the nodes take them ("layout: batch 2 x tp 2").
// Data: GET /api/rocm_parallel/status (nodes/routes.py), a snapshot the nodes keep up to date; polled
// once a second while a loader is on the canvas, and right after each progress / executing event.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const LOADER = "RocmParallelLoader";
const STATUS = "RocmParallelStatus";
const ROUTE = "/rocm_parallel/status";
const LINE = 15;

// `state`: the last snapshot; `byLoader`: the snapshot as answered for each loader's widgets (it adds
// `mismatch` when the running group is not what that loader asks for).
const panel = { state: null, error: null, byLoader: {} };
window.__rocmParallel = panel; // read by the browser test

// The server formats what it measures (sizes, units: nodes/registry.py `rank_line`, the Status node's
// too), so the panel and the Status node say the same thing in the same words.
export function panelLines(state, now = Date.now()) {
  if (!state) return ["ROCm Parallel: waiting for status..."];
  const lines = [];
  if (state.mismatch) lines.push(state.mismatch);
  if (!state.devices || !state.devices.length) {
    lines.push("ROCm Parallel: workers not started");
  } else {
    let phase = state.phase;
    if (phase === "sampling" && state.total) phase += ` ${state.step || 0}/${state.total}`;
    if (phase === "loading" && state.since) phase += ` ${Math.round(now / 1000 - state.since)} s`;
    lines.push(`${state.devices.length} workers: ${state.devices.join(", ")} (${phase})`);
    lines.push(`model: ${state.checkpoint || "none loaded"}`);
    if (state.layout) lines.push(`layout: ${state.layout}`);
    // Several loaders on these devices: every model stays resident (the one above was used last).
    if (state.models && state.models.length > 1)
      lines.push(
        `resident: ${state.models
          .map((m) => `${m.checkpoint} (${m.layout}${m.placement ? `, ${m.placement}` : ""})`)
          .join(", ")}`,
      );
    if (state.evicted) lines.push(state.evicted);
    // A slower transport the start-up pre-flight fell back to (backend/preflight.py); details: Status node.
    if (state.transport) lines.push(state.transport);
    if (state.loading) lines.push(`loading: ${state.loading}`);
    // The planner's one-line reason, split at "; " so it fits the node's width.
    if (state.auto) lines.push(...state.auto.split("; "));
    // A batch degree above the model calls' batch (its groups idle), said where the layout is shown.
    if (state.note) lines.push(state.note);
    // ComfyUI's own models moved off the workers' GPUs, and dynamic VRAM's budget beside them.
    for (const line of state.beside || []) lines.push(line);
    for (const r of state.ranks || []) lines.push(r.text);
    if (state.last) lines.push(`last job: ${state.last}`);
  }
  if (state.error) {
    // Wrapped when drawn; only a very long message is cut, and then visibly. Shown also when no group
    // runs: an input refused before any worker started is the last error too.
    const line = `last error: ${state.error}`;
    lines.push(line.length > 240 ? line.slice(0, 239) + "…" : line);
  }
  return lines;
}

// A line split at spaces (or anywhere, for one long word) so that it fits `width` pixels.
function wrap(ctx, text, width) {
  const out = [];
  let line = null; // leading spaces (indentation) are kept
  for (const word of text.split(" ")) {
    const next = line === null ? word : line + " " + word;
    if (line === null || ctx.measureText(next).width <= width) {
      line = next;
    } else {
      out.push(line);
      line = word;
    }
    while (ctx.measureText(line).width > width && line.length > 1) {
      let cut = line.length - 1;
      while (cut > 1 && ctx.measureText(line.slice(0, cut)).width > width) cut--;
      out.push(line.slice(0, cut));
      line = line.slice(cut);
    }
  }
  out.push(line ?? "");
  return out;
}

// Lines drawn under a node, outside its widgets, so they never change the node's saved layout; long
// lines wrap at the node's width instead of running over the nodes beside it.
function drawLines(node, ctx, lines, color) {
  const top = node.size[1] + 8;
  ctx.save();
  ctx.font = "12px monospace";
  const rows = lines.flatMap((text) => wrap(ctx, text, node.size[0] - 12));
  ctx.fillStyle = "rgba(20, 24, 32, 0.85)";
  ctx.fillRect(0, top, node.size[0], rows.length * LINE + 8);
  ctx.fillStyle = color;
  rows.forEach((text, i) => ctx.fillText(text, 6, top + 4 + (i + 1) * LINE - 3));
  ctx.restore();
  node.rocmParallelRows = rows.length; // read by the browser test (the panel's drawn height)
}

function loaders() {
  return (app.graph?._nodes || []).filter((n) => n.comfyClass === LOADER || n.type === LOADER);
}

// What a loader asks for, as the route's query (the server compares it with the running group).
function request(node) {
  const value = (name) => node.widgets?.find((w) => w.name === name)?.value ?? "";
  return new URLSearchParams({
    checkpoint: String(value("checkpoint")),
    devices: String(value("devices")),
    preload: String(value("preload")),
  }).toString();
}

async function poll() {
  const nodes = loaders();
  if (!nodes.length) return;
  try {
    const queries = [...new Set(nodes.map(request))];
    const answers = await Promise.all(
      queries.map(async (q) => [q, await (await api.fetchApi(`${ROUTE}?${q}`)).json()]),
    );
    panel.byLoader = Object.fromEntries(answers);
    panel.state = answers[0][1];
    panel.error = null;
  } catch (e) {
    panel.error = String(e);
  }
  app.graph?.setDirtyCanvas(true, false);
}

// This loader's snapshot; until the next poll after its widgets changed, the last one without a notice.
function stateFor(node) {
  return panel.byLoader[request(node)] ?? (panel.state && { ...panel.state, mismatch: null });
}

app.registerExtension({
  name: "rocm_parallel.status",
  setup() {
    setInterval(poll, 1000);
    api.addEventListener("progress", poll);
    api.addEventListener("executing", poll);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === STATUS) {
      // The Status node's text (its `ui.text` output), shown on the node after each run.
      const executed = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (message) {
        executed?.apply(this, arguments);
        this.rocmParallelLines = String(message?.text?.[0] ?? "").split("\n");
        this.setDirtyCanvas?.(true, false);
      };
      const drawStatus = nodeType.prototype.onDrawForeground;
      nodeType.prototype.onDrawForeground = function (ctx) {
        drawStatus?.apply(this, arguments);
        if (this.flags?.collapsed || !this.rocmParallelLines?.length) return;
        drawLines(this, ctx, this.rocmParallelLines, "#b8e0b8");
      };
      return;
    }
    if (nodeData.name !== LOADER) return;
    const draw = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      draw?.apply(this, arguments);
      if (this.flags?.collapsed) return;
      const state = stateFor(this);
      const lines = panel.error ? [`ROCm Parallel: ${panel.error}`] : panelLines(state);
      this.rocmParallelLines = lines;
      drawLines(this, ctx, lines, state?.error ? "#f0a0a0" : state?.mismatch ? "#f0d890" : "#b8e0b8");
    };
  },
});
