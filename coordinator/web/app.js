// The coordinator's live page: polls /status every few seconds and redraws the figures, the stages
// and two charts (uPlot, vendored next to this file).
//
// Peer ids, the run id and every other string in /status come from strangers on the network, so they
// reach the page only through textContent, title and data-* attributes: never parsed as HTML.
"use strict";

(() => {
  const POLL_MS = 3000; // between the end of one poll and the start of the next
  const TIMEOUT_MS = 2500; // a /status that takes longer than this counts as unreachable
  const CHART_HEIGHT = 220;
  const KNOWN_STATES = new Set(["JOINING", "ONLINE", "OFFLINE"]);

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function number(x, digits) {
    if (x === null || x === undefined) return "–";
    return Number(x).toLocaleString(undefined, { maximumFractionDigits: digits });
  }

  // Peer ids share long prefixes ("12D3KooW..."): their tails tell them apart. The full id is the
  // row's tooltip and its data-peer-id.
  function shortPeerId(id) {
    return id.length > 12 ? "…" + id.slice(-8) : id;
  }

  function clock(date) {
    return date.toLocaleTimeString();
  }

  // --- charts --------------------------------------------------------------------------------

  function makeChart(container, label, color) {
    const style = getComputedStyle(document.documentElement);
    const muted = style.getPropertyValue("--muted").trim();
    const line = style.getPropertyValue("--line").trim();
    const axis = { stroke: muted, grid: { stroke: line, width: 1 }, ticks: { stroke: line, width: 1 } };
    const options = {
      width: container.clientWidth,
      height: CHART_HEIGHT,
      legend: { show: false },
      scales: { x: { time: true } }, // x: unix seconds, shown in the viewer's time zone
      axes: [axis, { ...axis, size: 60 }],
      series: [{}, { label, stroke: color, width: 2 }],
    };
    return new uPlot(options, [[], []], container);
  }

  // A null value (e.g. no trainer had reported a loss yet) is a gap in the line, not a zero.
  // data-points (the points the chart holds) says whether there is anything to see, to people
  // (CSS shows a note on an empty chart) and to tests.
  function setSeries(chart, container, times, values) {
    chart.setData([times, values]);
    container.dataset.points = String(chart.data[1].filter((v) => v !== null).length);
  }

  const lossChart = makeChart($("loss-chart"), "loss", "#c2410c");
  const spsChart = makeChart($("sps-chart"), "samples/s", "#2563eb");

  window.addEventListener("resize", () => {
    for (const [chart, id] of [[lossChart, "loss-chart"], [spsChart, "sps-chart"]]) {
      chart.setSize({ width: $(id).clientWidth, height: CHART_HEIGHT });
    }
  });

  // --- figures and stages --------------------------------------------------------------------

  function renderStage(stage, isBottleneck) {
    const card = el("section", "stage");
    card.dataset.stage = String(stage.stage);
    const title = el("h3", null, `Stage ${stage.stage}`);
    if (isBottleneck) {
      card.classList.add("bottleneck");
      card.dataset.bottleneck = "true";
      title.append(el("span", "badge", "bottleneck"));
    }
    const summary = `${stage.online} of ${stage.servers.length} servers online · ` +
      `${number(stage.throughput, 1)} samples/s`;
    card.append(title, el("p", "summary", summary));

    if (stage.servers.length === 0) {
      card.append(el("p", "none", "No servers: the swarm cannot train until one joins this stage."));
      return card;
    }
    const table = el("table");
    const head = el("tr");
    head.append(el("th", null, "server"), el("th", null, "state"), el("th", "num", "samples/s"),
      el("th", "num", "step"));
    table.append(el("thead"));
    table.tHead.append(head);
    const body = el("tbody");
    for (const server of stage.servers) {
      const row = el("tr", server.state === "OFFLINE" ? "offline" : null);
      row.dataset.peerId = server.peer_id;
      const id = el("code", null, shortPeerId(server.peer_id));
      id.title = server.peer_id;
      const idCell = el("td");
      idCell.append(id);
      const known = KNOWN_STATES.has(server.state);
      const state = el("td", known ? "state-" + server.state.toLowerCase() : "state-other", server.state);
      row.append(idCell, state, el("td", "num", number(server.throughput, 1)), el("td", "num", number(server.step, 0)));
      body.append(row);
    }
    table.append(body);
    card.append(table);
    return card;
  }

  // One row per expert: its ONLINE hosts, and a warning when it has none (its tokens go without it).
  function renderExperts(experts) {
    const table = el("table");
    const head = el("tr");
    head.append(el("th", null, "expert"), el("th", "num", "hosts online"), el("th", null, "hosts"));
    table.append(el("thead"));
    table.tHead.append(head);
    const body = el("tbody");
    for (const expert of experts) {
      const online = expert.hosts.filter((host) => host.state === "ONLINE");
      const row = el("tr", online.length === 0 ? "unhosted" : null);
      row.dataset.expert = String(expert.expert);
      const hosts = el("td");
      for (const host of expert.hosts) {
        const id = el("code", host.state === "ONLINE" ? null : "state-other", shortPeerId(host.peer_id));
        id.title = `${host.peer_id} (${host.state})`;
        hosts.append(id, " ");
      }
      if (expert.hosts.length === 0) hosts.append("none: its tokens go on without it");
      row.append(el("td", null, String(expert.expert)), el("td", "num", String(online.length)), hosts);
      body.append(row);
    }
    table.append(body);
    return table;
  }

  function render(status) {
    $("run-id").textContent = status.run_id;
    document.title = `swarm · ${status.run_id} · step ${status.step}`;
    $("step").textContent = number(status.step, 0);
    $("loss").textContent = status.loss == null ? "–" : Number(status.loss).toPrecision(4);
    $("samples-per-second").textContent = number(status.samples_per_second, 1);
    $("volunteers").textContent = number(status.volunteers, 0);
    $("trainers").textContent = number(status.trainers, 0);
    $("samples").textContent = number(status.samples, 0);
    $("stages").replaceChildren(
      ...status.stages.map((stage) => renderStage(stage, stage.stage === status.bottleneck_stage)));
    const experts = Array.isArray(status.experts) ? status.experts : null;
    $("experts-section").hidden = experts === null;
    if (experts !== null) $("experts").replaceChildren(renderExperts(experts));
    if (status.history) {
      const h = status.history;
      setSeries(lossChart, $("loss-chart"), h.time, h.loss);
      setSeries(spsChart, $("sps-chart"), h.time, h.samples_per_second);
    }
  }

  // --- polling -------------------------------------------------------------------------------

  let rendered = 0; // /status documents shown so far (data-rendered on <body>, for tests)
  let lastGood = null;
  let failingSince = null;

  function reachable() {
    lastGood = new Date();
    failingSince = null;
    $("notice").hidden = true;
    $("main").classList.remove("stale");
    $("updated").textContent = `updated ${clock(lastGood)} · every ${POLL_MS / 1000} s`;
  }

  // `what`: "Coordinator unreachable" when /status did not come, something else when it came unreadable.
  function unreachable(reason, what = "Coordinator unreachable") {
    failingSince = failingSince || new Date();
    const shown = lastGood ? `The figures below are from ${clock(lastGood)}.` : "Nothing to show yet.";
    $("notice").textContent = `${what} since ${clock(failingSince)} (${reason}). ` +
      `Retrying every ${POLL_MS / 1000} s. ${shown}`;
    $("notice").hidden = false;
    $("main").classList.add("stale");
    document.body.dataset.reachable = "false";
  }

  async function poll() {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      let status;
      try {
        const reply = await fetch("status", { cache: "no-store", signal: abort.signal });
        if (!reply.ok) throw new Error(`/status answered HTTP ${reply.status}`);
        status = await reply.json();
      } catch (e) {
        // fetch() rejects with a TypeError when there is no connection at all; its text varies by browser.
        const reason = e.name === "AbortError" ? `no answer within ${TIMEOUT_MS / 1000} s`
          : e.name === "TypeError" ? "no connection" : e.message;
        unreachable(reason);
        return;
      }
      render(status);
      reachable();
      rendered += 1;
      document.body.dataset.rendered = String(rendered);
      document.body.dataset.reachable = "true";
    } catch (e) { // a /status this page cannot draw: say so rather than show half of it
      unreachable(e.message, "Cannot show the coordinator's /status");
    } finally {
      clearTimeout(timer);
      setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();
