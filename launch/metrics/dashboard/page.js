// Renders the dashboard from the JSON blob in #dashboard-data; status and timings land on <body data-*>.
(function () {
  const data = JSON.parse(document.getElementById("dashboard-data").textContent);
  const view = new URLSearchParams(location.hash.slice(1)).get("view");
  const config = {responsive: true, displaylogo: false, displayModeBar: view ? false : "hover"};

  function floats(spec) {
    const text = atob(spec.bdata);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return new Float32Array(bytes.buffer);
  }

  function missing(title, message) {
    return {data: [], layout: {title: {text: title}, height: 220, xaxis: {visible: false}, yaxis: {visible: false},
      annotations: [{text: message, showarrow: false, x: 0.5, y: 0.5, xref: "paper", yref: "paper"}]}};
  }

  function loadFigure(run, layer) {
    const arrays = run.layer_arrays.load;
    const title = run.name + ": expert load / mean, MoE layer " + layer;
    if (!arrays) return missing(title, "no per-expert loads in this run's metrics");
    if (layer >= arrays.layers.length) return missing(title, "this run has " + arrays.layers.length + " MoE layers");
    return {data: [{type: "heatmap", z: arrays.layers[layer], x: arrays.steps, colorscale: "Viridis", zmin: 0,
                    hovertemplate: "step %{x:.0f}<br>expert %{y}<br>load/mean %{z:.3f}<extra></extra>"}],
            layout: {title: {text: title}, height: 420, xaxis: {title: {text: "step"}},
                     yaxis: {title: {text: "expert"}}, margin: {l: 60, r: 20, t: 40, b: 40}}};
  }

  function biasFigure(run, layer) {
    const arrays = run.layer_arrays.bias;
    const title = run.name + ": expert bias, MoE layer " + layer;
    if (!arrays) return missing(title, "no expert-bias vectors in this run's metrics");
    if (layer >= arrays.layers.length) return missing(title, "this run has " + arrays.layers.length + " MoE layers");
    const steps = Array.from(floats(arrays.steps));
    const bias = floats(arrays.layers[layer]);
    const experts = run.layer_arrays.experts;
    const traces = [];
    for (let e = 0; e < experts; e++) {
      const y = steps.map((_, b) => bias[b * experts + e]);
      traces.push({type: "scatter", mode: "lines", x: steps, y: y, name: "expert " + e,
                   line: {width: 1}, showlegend: experts <= 16});
    }
    return {data: traces, layout: {title: {text: title}, height: 360, xaxis: {title: {text: "step"}},
                                   yaxis: {title: {text: "bias"}}, margin: {l: 60, r: 20, t: 40, b: 40}}};
  }

  function draw(id, figure) {
    const div = document.getElementById(id);
    if (!div || (view && view !== id)) return;
    const began = performance.now();
    Plotly.react(div, figure.data, figure.layout, config);
    div.dataset.renderMs = (performance.now() - began).toFixed(0);
    if (!document.body.dataset.firstChartMs) document.body.dataset.firstChartMs = performance.now().toFixed(0);
  }

  function drawLayer() {
    const layer = Number(document.getElementById("layer").value);
    data.runs.forEach((run, r) => {
      draw("load-" + r, loadFigure(run, layer));
      draw("bias-" + r, biasFigure(run, layer));
    });
  }

  try {
    if (view) document.body.classList.add("single-view");
    data.charts.forEach(chart => draw(chart.id, chart.figure));
    document.getElementById("layer").addEventListener("change", drawLayer);
    drawLayer();
  } catch (error) {
    window.dashboardErrors.push(String(error && error.stack || error));
  }
  document.body.dataset.renderedMs = performance.now().toFixed(0);
  if (view) document.querySelectorAll(".chart").forEach(div => { if (div.id !== view) div.remove(); });
  document.body.dataset.status = window.dashboardErrors.length ? "error" : "rendered";
  document.getElementById("dashboard-errors").textContent = window.dashboardErrors.join("\n");
  if (data.live) {
    setInterval(() => fetch("version").then(r => r.text()).then(v => { if (v !== data.version) location.reload(); })
      .catch(() => {}), data.live * 1000);
  }
})();
