// swarm_page.js: the browser half of tests/swarm_view_test.sh. Loads the
// swarm page from HM_URL in headless Chromium, checks that it lists the
// five nodes and the eight experts with their hosts, kills HM_VICTIM_PID
// and waits for the page, without a reload, to mark HM_VICTIM_ID down.
// Fails (exit 1) with what the page showed.
"use strict";
const { chromium } = require("playwright-core");

const url = process.env.HM_URL;
const victimPid = Number(process.env.HM_VICTIM_PID);
const victimId = process.env.HM_VICTIM_ID;
const shot = process.env.HM_SCREENSHOT;

function fail(msg, extra) {
  console.error("swarm_page: " + msg);
  if (extra) console.error(extra);
  process.exit(1);
}

(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.HM_CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--no-sandbox", "--disable-background-networking", "--disable-gpu"],
  });
  const external = [];
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
    // Nothing but the daemon that served the page may be asked for anything.
    page.on("request", (r) => { if (!r.url().startsWith(url)) external.push(r.url()); });
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    const res = await page.goto(url);
    if (!res || res.status() !== 200) fail("GET / answered " + (res && res.status()));

    const rows = async () => page.$$eval("#nodes tbody tr", (trs) =>
      trs.map((tr) => ({ peer: tr.cells[0].dataset.peer, state: tr.cells[2].textContent })));
    await page.waitForFunction(() =>
      document.querySelectorAll("#nodes tbody tr").length >= 5 &&
      document.querySelectorAll("#experts tbody tr").length >= 8, null, { timeout: 20000 })
      .catch(async () => fail("the page did not list 5 nodes and 8 experts",
                              await page.textContent("main")));
    const before = await rows();
    if (before.filter((r) => r.state === "up").length !== 5)
      fail("not every node is up", JSON.stringify(before));
    if (!before.some((r) => r.peer === victimId)) fail("the victim is not listed", JSON.stringify(before));
    const experts = await page.$$eval("#experts tbody tr", (trs) =>
      trs.map((tr) => [tr.cells[0].textContent, tr.cells[1].textContent]));
    const uids = experts.map((e) => e[0]).sort();
    const want = [];
    for (let i = 0; i < 2; i++) for (let j = 1; j <= 4; j++) want.push("tg." + i + "." + j);
    if (JSON.stringify(uids) !== JSON.stringify(want.sort()))
      fail("the grid shows " + JSON.stringify(uids));
    if (experts.some((e) => e[1].length < 6)) fail("an expert without its host", JSON.stringify(experts));
    const count = await page.textContent("#nodes-count");
    if (count.trim() !== "5 up of 5") fail("the count says " + count);
    if (shot) await page.screenshot({ path: shot, fullPage: true });

    process.kill(victimPid, "SIGKILL");
    const t0 = Date.now();
    await page.waitForFunction((id) => {
      const td = document.querySelector('#nodes td[data-peer="' + id + '"]');
      return td && td.parentElement.cells[2].textContent === "down" &&
        document.querySelector("#nodes-count").textContent.trim() === "4 up of 5";
    }, victimId, { timeout: 20000 }).catch(async () => fail("the killed node is not shown down",
                                                            JSON.stringify(await rows())));
    console.log("swarm_page: 5 nodes and 8 experts shown; the killed node shown down after " +
                ((Date.now() - t0) / 1000).toFixed(1) + " s");
    if (errors.length) fail("script errors on the page", errors.join("\n"));
    if (external.length) fail("the page asked for other hosts", external.join("\n"));
  } finally {
    await browser.close();
  }
})().catch((e) => fail(String(e && e.stack || e)));
