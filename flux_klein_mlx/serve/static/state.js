// What the page's modules share: `$`, the page's state, and `actions`, the page's own functions that the
// other modules call back (page.js fills it as it loads: renderFiles, reuseSettings, downloadLink, useButtons,
// describeMode). Every module imports from here and page.js imports the others, so no two modules import
// each other.
export const $ = (id) => document.getElementById(id);
export const HISTORY_MAX = 40;
// server: the last /v1/status read (null until one succeeds); keyNeeded: the last read was refused (401);
// detail: what our own run's stream last said ("step 2 / 4"), shown only while the server says it runs.
export const state = { refs: [], mask: null, busy: false, controller: null, server: null, history: [], keyNeeded: false,
                       detail: "" };
export const actions = {};
