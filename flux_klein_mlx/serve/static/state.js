// What the page's modules share: `$`, the page's state, and `actions`, the page's own functions that the
// other modules call back (page.js fills it as it loads: renderFiles, reuseSettings, downloadLink, useButtons,
// describeMode, headers, refreshStatus; train.js: showTab). Every module imports from here; page.js imports the
// others (train.js its own two, trainjob.js and zip.js), so no two modules import each other.
export const $ = (id) => document.getElementById(id);
export const HISTORY_MAX = 40;
// server: the last /v1/status read (null until one succeeds); keyNeeded: the last read was refused (401);
// detail: what our own run's stream last said ("step 2 / 4"), shown only while the server says it runs.
// train: the Train tab's (train.js, trainjob.js): the images with their captions, a zip's control files, the
// job followed, its losses ({step, loss, total}) and samples.
export const state = { refs: [], mask: null, busy: false, controller: null, server: null, history: [], keyNeeded: false,
                       detail: "", train: { items: [], extra: [], job: null, following: null, losses: [], samples: [], checkpoints: 0,
                                            seen: new Set(), plan: null } };
export const actions = {};
