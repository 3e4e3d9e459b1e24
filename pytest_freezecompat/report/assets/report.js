(function () {
  'use strict';
  // The records arrive compact (html.py `_Payload`): positional rows whose strings and texts are indices into
  // shared tables. Everything read from them reaches the page through textContent, never as markup.
  const payload = JSON.parse(document.getElementById('cell-data').textContent);
  const strings = payload.strings;
  function value(v, kind) {
    const list = kind === 'S' || kind.charAt(0) === '[';
    if (v === null || v === undefined) return list ? [] : null;
    if (kind === 's') return strings[v];
    if (kind === 'v') return v;
    if (kind === 'S') return v.map(i => strings[i]);
    if (kind === 't' || kind === 'r') return payload.texts[v].map(i => strings[i]).join('');
    if (kind === 'k') return payload.issues[v];
    if (list) return v.map(row => decode(row, kind.slice(1, -1)));
    return decode(v, kind);
  }
  function decode(row, shape) {
    const record = {};
    payload.shapes[shape].forEach(([name, kind], i) => { record[name] = value(row[i], kind); });
    return record;
  }
  const cells = payload.cells.map(row => decode(row, 'cell'));
  const byId = new Map(cells.map((c, i) => [c.id, i]));
  const buttons = Array.from(document.querySelectorAll('button.cell'));
  const selects = Array.from(document.querySelectorAll('select[data-axis]'));
  const panel = document.getElementById('details');
  const body = document.getElementById('details-body');
  const bar = document.getElementById('filters');

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function label(c) {
    let t = c.id + ': ' + c.severity + ' · ' + c.status + (c.check ? ' [' + c.check + ']' : '');
    if (c.display !== c.status) t += ' (' + c.display + ': ' + c.known_issue.id + ')';
    t += ' · activation checkpointing ' + c.checkpoint + (c.clip === 'clip' ? '' : ' · ' + c.clip);
    if (c.emulation) t += ' · emulated';
    if (c.cause) t += ' · cause: ' + c.cause;
    if (c.resume === 'failed') t += ' · resume failed';
    const held = c.workarounds.find(w => w.holds);
    if (held) t += ' · instead: ' + held.says + ' (' + held.workaround + ')';
    else if (c.instead.length) t += (c.instead[0].change.includes(', ') ? ' · no safe setup one change away; nearest: '
      : ' · instead: ') + c.instead[0].change + ' (' + c.instead[0].severity + ')';
    else if (c.severity === 'silent' || c.severity === 'refused') t += ' · no safe setup one change away';
    return t;
  }
  buttons.forEach(b => {
    const c = cells[+b.dataset.i];
    b.dataset.id = c.id;
    b.title = label(c);
    b.setAttribute('aria-label', b.title);
  });

  function wanted() {
    const w = {};
    selects.forEach(s => { if (s.value) w[s.dataset.axis] = s.value; });
    return w;
  }
  function matches(c, w) {
    return (!w.severity || c.severity === w.severity) && (!w.framework || c.framework === w.framework) && (!w.plugin || c.plugin === w.plugin)
      && (!w.freeze || c.freeze === w.freeze) && (!w.clip || c.clip === w.clip) && (!w.status || c.display === w.status || c.status === w.status)
      && (!w.cause || c.cause === w.cause) && (!w.resume || c.resume === w.resume);
  }
  function summarize(shown, w) {
    // Same counting as grid.py's Section: raw statuses, plus known / fixed? where the registry says so.
    const counts = {};
    const bump = (f, k) => { counts[f] = counts[f] || {}; counts[f][k] = (counts[f][k] || 0) + 1; };
    cells.forEach((c, i) => {
      if (!shown[i]) return;
      [c.framework, ''].forEach(f => {
        bump(f, 'cells');
        bump(f, 'sev:' + c.severity);
        if ((c.severity === 'silent' || c.severity === 'refused') && c.display !== 'known') bump(f, 'untied');
        bump(f, c.status);
        if (c.display !== c.status) bump(f, c.display);
        if (c.cause) bump(f, 'red:' + c.cause);
        if (c.resume) bump(f, 'resume:' + c.resume);
      });
    });
    document.querySelectorAll('table.counts tr[data-framework]').forEach(tr => {
      const got = counts[tr.dataset.framework] || {};
      tr.querySelectorAll('td[data-k]').forEach(td => {
        const n = got[td.dataset.k] || 0;
        td.textContent = String(n);
        td.classList.toggle('zero', n === 0);
      });
    });
    const scope = Object.keys(w).map(k => k + ' = ' + w[k]).join(', ');
    document.getElementById('summary-scope').textContent = scope ? '(cells where ' + scope + ')' : '(every cell)';
  }
  function fit() {
    // A grid that fits gets no scroll box, so its header can stick under the filters; a wider one scrolls alone.
    document.documentElement.style.setProperty('--bar', bar.offsetHeight + 'px');
    document.querySelectorAll('.gridbox').forEach(box => {
      box.classList.remove('fits');
      box.classList.toggle('fits', box.firstElementChild.offsetWidth <= box.clientWidth);
    });
  }
  function apply() {
    // Squares keep their slot (visibility): a square's column always tells its plugin and checkpoint mode.
    const w = wanted();
    const shown = cells.map(c => matches(c, w));
    buttons.forEach(b => b.classList.toggle('out', !shown[+b.dataset.i]));
    const column = w.plugin ? payload.plugins.indexOf(w.plugin) : -1;
    document.querySelectorAll('.grid [data-p]').forEach(e => { e.hidden = column >= 0 && +e.dataset.p !== column; });
    document.querySelectorAll('tr[data-freeze]').forEach(e => { e.hidden = !!w.freeze && e.dataset.freeze !== w.freeze; });
    document.querySelectorAll('tbody.block,section.framework').forEach(e => {
      e.hidden = !e.querySelector('button.cell:not(.out)');
    });
    const n = shown.filter(Boolean).length;
    document.getElementById('shown').textContent = n + ' of ' + cells.length + ' cells shown';
    summarize(shown, w);
    fit();
  }

  function add(dl, term, text) {
    if (text === undefined || text === null || text === '') return;
    dl.append(el('dt', term), el('dd', text));
  }
  function pre(parent, title, text) {
    if (text) parent.append(el('h3', title), el('pre', text));
  }
  function link(href) {
    const a = el('a', href);
    if (/^https?:\/\//.test(href)) { a.href = href; a.target = '_blank'; a.rel = 'noopener noreferrer'; }
    return a;
  }
  function cellLink(id) {
    // Another cell of this page: clicking opens its details (the hash opens it, as the notes' links do).
    const a = el('a', id);
    a.href = '#' + encodeURIComponent(id);
    return a;
  }
  function show(i) {
    const c = cells[i];
    buttons.forEach(b => b.classList.toggle('active', +b.dataset.i === i));
    body.replaceChildren(el('h2', c.id));
    const line = el('p');
    line.append(el('span', c.severity, 'badge sev-' + c.severity));
    line.append(el('span', c.status, 'badge d-' + c.status));
    if (c.display !== c.status) line.append(el('span', c.display, 'badge d-' + c.display.replace('?', '')));
    if (c.check) line.append(el('span', 'failed check: ' + c.check));
    body.append(line);
    const dl = el('dl', undefined, 'facts');
    ['model', 'framework', 'plugin', 'init', 'checkpoint', 'freeze', 'clip', 'environment', 'precision', 'world_size']
      .forEach(k => add(dl, k, c[k]));
    const emulated = [];
    c.rank_details.forEach(r => r.emulated.forEach(x => { if (!emulated.includes(x)) emulated.push(x); }));
    add(dl, 'emulation', c.emulation ? 'yes (CUDA-on-CPU shim)' + (emulated.length ? ': ' + emulated.join('; ') : '')
      : 'no');
    add(dl, 'grad access', c.grad_access);
    add(dl, 'save → load (resume)', c.resume_api ? c.resume_api + ' · round trip ' + (c.resume || 'not judged')
      : 'no round trip');
    if (c.round_trip_of) {
      // Cells of one round-trip group take one save → load path: the first to judge it ran it, this one cites it.
      const dd = el('dd', 'shared, run by ');
      dd.append(cellLink(c.round_trip_of));
      dl.append(el('dt', 'round trip'), dd);
    }
    add(dl, 'grad norm source', c.grad_norm_source);
    if (c.duration_s !== null) add(dl, 'duration', c.duration_s + ' s');
    add(dl, 'cause', c.cause);
    add(dl, 'loop judged', c.convention);
    add(dl, 'tolerance', c.tolerance || 'none stated (a refusal, or a report written before tolerances were stated)');
    add(dl, 'stack as it ran', c.stack || 'not observed (refused before the stack was built, or a report written '
      + 'before the stack was recorded)');
    add(dl, 'versions', c.versions);
    if (c.tied.length) add(dl, 'tied (one tensor)', c.tied.join('; '));
    body.append(dl);
    if (c.unchecked.length) {
      const ul = el('ul');
      c.unchecked.forEach(u => ul.append(el('li', u)));
      body.append(el('h3', 'not checked on this cell (unproven: not safe until it is)'), ul);
    }
    if (c.differences.length) {
      const ul = el('ul');
      c.differences.forEach(d => ul.append(el('li', d)));
      body.append(el('h3', 'differs from the canonical loop (reaches no weight)'), ul);
    }
    pre(body, c.status === 'skip' ? 'reason' : 'message', c.message);
    if (c.failures.length > 1) {
      const ul = el('ul');
      c.failures.forEach(f => {
        const li = el('li');
        li.append(el('strong', f.check + (f.step !== null && f.step >= 0 ? ' (from step ' + f.step + ')' : '')));
        if (f.message) li.append(el('span', ': ' + f.message));
        if (f.params.length) li.append(el('div', 'params: ' + f.params.join(', ')));
        ul.append(li);
      });
      body.append(el('h3', 'every failed check'), ul);
    }
    const k = c.known_issue;
    if (k) {
      body.append(el('h3', 'known issue'));
      const p = el('p');
      p.append(el('strong', k.id + (k.kind_words ? ' (' + k.kind_words + ')' : '')));
      if (k.summary) p.append(el('span', ' — ' + k.summary));
      if (c.cpu_only) p.append(el('div', c.cpu_only));
      const ul = el('ul');
      k.links.forEach(h => { const li = el('li'); li.append(link(h)); ul.append(li); });
      if (k.reproducer) ul.append(el('li', 'reproducer: ' + k.reproducer + ' (run it with the environment\'s python)'));
      body.append(p, ul);
    }
    if (c.workarounds.length || c.instead.length || c.severity === 'silent' || c.severity === 'refused') {
      // What to do instead: the entry's workarounds as this very cell's neighbours say, then the nearest safe setups.
      const ul = el('ul');
      c.workarounds.forEach(w => {
        const li = el('li');
        li.append(el('strong', w.says), el('span', ' (' + w.workaround + '): ' + w.outcome + (w.proof ? ': ' : '')));
        if (w.proof) li.append(cellLink(w.proof));
        ul.append(li);
      });
      c.instead.forEach(a => {
        const li = el('li');
        li.append(el('strong', a.change), el('span', ' — safe (' + a.severity + '): '), cellLink(a.cell));
        ul.append(li);
      });
      if (!c.workarounds.length && !c.instead.length) ul.append(el('li', 'no safe setup of this model, pattern and framework in this report'));
      if (k && k.no_workaround) ul.append(el('li', 'no workaround known: ' + k.no_workaround));
      if (c.cpu_only) ul.prepend(el('li', c.cpu_only + ': what follows is for CPU runs'));
      body.append(el('h3', 'what to do instead'), ul);
    }
    if (c.notes.length) {
      const ul = el('ul');
      c.notes.forEach(n => ul.append(el('li', n)));
      body.append(el('h3', 'notes'), ul);
    }
    pre(body, 'reproduce', c.repro);
    c.rank_details.forEach(r => {
      const box = el('div', undefined, 'rank');
      box.append(el('h3', 'rank ' + r.rank + ' — last phase: ' + r.phase));
      const facts = el('dl', undefined, 'facts');
      if (r.error) {
        add(facts, 'error', r.error.type + ': ' + r.error.message);
        add(facts, 'where', r.error.where);
        add(facts, 'phase', r.error.phase);
      }
      add(facts, 'exit', r.exit);
      if (r.emulated.length) add(facts, 'emulated', r.emulated.join('; '));
      box.append(facts);
      pre(box, 'traceback', r.traceback);
      pre(box, 'stack', r.stack);
      pre(box, 'log tail', r.log_tail);
      body.append(box);
    });
    panel.hidden = false;
    if (decodeURIComponent(location.hash.slice(1)) !== c.id) history.replaceState(null, '', '#' + encodeURIComponent(c.id));
  }
  function hide() {
    panel.hidden = true;
    buttons.forEach(b => b.classList.remove('active'));
    history.replaceState(null, '', location.pathname + location.search);
  }
  function fromHash() {
    // A cell's id in the address opens it (the notes link there); a section's anchor just scrolls.
    const i = byId.get(decodeURIComponent(location.hash.slice(1)));
    if (i !== undefined) show(i);
  }
  buttons.forEach(b => b.addEventListener('click', () => show(+b.dataset.i)));
  selects.forEach(s => s.addEventListener('change', apply));
  document.getElementById('close').addEventListener('click', hide);
  document.addEventListener('keydown', e => { if (e.key === 'Escape') hide(); });
  window.addEventListener('hashchange', fromHash);
  window.addEventListener('resize', fit);
  apply();
  fromHash();
})();
