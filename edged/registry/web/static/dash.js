// edged registry dashboard: live regions (polling with ETags) and uPlot charts. No other dependency.
(function () {
  "use strict";
  var COLORS = ["#1f6feb", "#d1242f", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0a7ea4", "#57606a"];
  var charts = [];

  function chartWidth(fig) { return Math.max(200, Math.min(fig.clientWidth - 18, 900)); }

  var resizing = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizing);
    resizing = setTimeout(function () {
      charts.forEach(function (c) { c.plot.setSize({ width: chartWidth(c.fig), height: 200 }); });
    }, 100);
  });

  function drawCharts(root) {
    charts.forEach(function (c) { c.plot.destroy(); });
    charts = [];
    if (typeof uPlot === "undefined") { return; }
    root.querySelectorAll("script.chart-data").forEach(function (el) {
      var spec = JSON.parse(el.textContent);
      var fig = el.parentNode;
      var any = spec.series.some(function (s) { return s.values.some(function (v) { return v !== null; }); });
      if (!spec.x.length || !any) { return; }
      var holder = document.createElement("div");
      holder.className = "plot";
      fig.appendChild(holder);
      var width = chartWidth(fig);
      var series = [{}];
      var data = [spec.x];
      var summary = [];
      spec.series.forEach(function (s, i) {
        // no line across a gap: a null is a period the version was not served (or nothing was reported)
        series.push({ label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false });
        data.push(s.values);
        var last = null;
        for (var k = s.values.length - 1; k >= 0; k--) { if (s.values[k] !== null) { last = s.values[k]; break; } }
        summary.push(s.label + " latest " + (last === null ? "none" : last + " " + spec.unit));
      });
      holder.setAttribute("role", "img");
      holder.setAttribute("aria-label", spec.title + ": " + spec.x.length + " points; " + summary.join("; "));
      var u = new uPlot({ width: width, height: 200, series: series,
                          axes: [{}, { label: spec.unit, size: 56 }], legend: { live: false } }, data, holder);
      fig.setAttribute("data-drawn", String(spec.x.length));
      charts.push({ plot: u, fig: fig });
    });
  }

  function start() {
    var live = document.getElementById("live");
    drawCharts(document);
    if (!live) { return; }
    var etag = live.getAttribute("data-etag");
    var interval = Math.max(500, parseFloat(live.getAttribute("data-interval") || "5") * 1000);
    var url = live.getAttribute("data-url");
    url += (url.indexOf("?") < 0 ? "?" : "&") + "part=live";
    var status = document.getElementById("updated");
    var busy = false;
    var failed = false;
    var banner = document.getElementById("stale-banner");
    var asOf = new Date();  // when what the page shows was last fetched

    // The live feed failed: what stays on screen is greyed and says how old it is, and a banner says why.
    function markStale(why) {
      live.classList.add("stale");
      live.setAttribute("aria-describedby", "stale-banner");
      if (banner) {
        banner.textContent = "Live updates are failing (" + why + "): the figures below are as of " +
          asOf.toLocaleTimeString() + ", not current.";
        banner.hidden = false;
      }
    }

    function markFresh() {
      asOf = new Date();
      live.classList.remove("stale");
      live.removeAttribute("aria-describedby");
      if (banner) { banner.hidden = true; banner.textContent = ""; }
    }

    function poll() {
      if (busy || document.hidden) { return; }
      busy = true;
      fetch(url, { headers: { "If-None-Match": etag || "" }, credentials: "same-origin", cache: "no-store" })
        .then(function (r) {
          if (r.status === 401) { window.location.href = live.getAttribute("data-login") || "login"; return null; }
          if (r.status === 304) { return null; }
          if (!r.ok) { throw new Error("HTTP " + r.status); }
          etag = r.headers.get("ETag");
          return r.text();
        })
        .then(function (html) {
          if (html !== null && html !== undefined) {
            live.innerHTML = html;
            drawCharts(live);
            // the status line is a polite live region: say something only when the page changed
            if (status) { status.textContent = "Updated at " + new Date().toLocaleTimeString() + "."; }
          } else if (failed && status) {
            status.textContent = "Up to date again at " + new Date().toLocaleTimeString() + ".";
          }
          failed = false;
          markFresh();
          live.setAttribute("data-polls", String(parseInt(live.getAttribute("data-polls") || "0", 10) + 1));
        })
        .catch(function (e) {
          failed = true;
          if (status) { status.textContent = "Update failed (" + e.message + "); retrying."; }
          markStale(e.message);
        })
        .then(function () { busy = false; });
    }
    setInterval(poll, interval);
    document.addEventListener("visibilitychange", poll);
  }

  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
})();
