// Runs the console's app.js in node against a stand-in DOM that accepts anything, with the localStorage given in
// argv[3] (JSON), and prints the fetches the page made while starting (url and headers) as JSON.
"use strict";
const fs = require("fs");
const vm = require("vm");

const stub = () => {
  const fn = function () { return stub(); };
  return new Proxy(fn, {
    get(target, prop) {
      if (prop === Symbol.toPrimitive) return () => "";
      if (prop === Symbol.iterator) return function* () {};
      if (prop === "then") return undefined; // not a promise
      if (prop in target) return target[prop];
      target[prop] = stub();
      return target[prop];
    },
    set(target, prop, value) { target[prop] = value; return true; },
    apply() { return stub(); },
    construct() { return stub(); },
  });
};

const store = new Map(Object.entries(JSON.parse(process.argv[3] || "{}")));
const fetches = [];
const sandbox = {
  console, setTimeout: () => 0, clearTimeout: () => {}, setInterval: () => 0, clearInterval: () => {},
  performance: { now: () => 0 }, Date, Math, JSON, Number, String, Object, Array, Map, Set, Promise, Error, Symbol,
  AbortController, TextDecoder, URL, Intl,
  document: stub(), navigator: stub(), matchMedia: () => stub(), requestAnimationFrame: () => 0,
  ResizeObserver: function () { return stub(); }, MutationObserver: function () { return stub(); },
  localStorage: {
    getItem: (k) => (store.has(k) ? store.get(k) : null),
    setItem: (k, v) => store.set(k, String(v)), removeItem: (k) => store.delete(k),
  },
  fetch: (url, init) => {
    fetches.push({ url: String(url), headers: (init && init.headers) || {} });
    return new Promise(() => {}); // never answers: only what was sent matters
  },
};
sandbox.window = sandbox;
sandbox.document.querySelector = () => null;
vm.createContext(sandbox);
vm.runInContext(fs.readFileSync(process.argv[2], "utf8"), sandbox, { filename: "app.js" });
setImmediate(() => process.stdout.write(JSON.stringify(fetches)));
