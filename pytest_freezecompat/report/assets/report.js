(function () {
  const data = JSON.parse(document.getElementById('cell-data').textContent);
  const buttons = Array.from(document.querySelectorAll('button.cell'));
  const selects = Array.from(document.querySelectorAll('select[data-axis]'));
  const panel = document.getElementById('details');
  const body = document.getElementById('details-body');

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function wanted() {
    const w = {};
    selects.forEach(s => { if (s.value) w[s.dataset.axis] = s.value; });
    return w;
  }
  function visible(b, w) {
    return (!w.framework || b.dataset.framework === w.framework) && (!w.plugin || b.dataset.plugin === w.plugin)
      && (!w.freeze || b.dataset.freeze === w.freeze)
      && (!w.status || b.dataset.display === w.status || b.dataset.status === w.status)
      && (!w.cause || b.dataset.cause === w.cause);
  }
  function apply() {
    const w = wanted();
    let shown = 0;
    buttons.forEach(b => { const v = visible(b, w); b.hidden = !v; if (v) shown++; });
    document.querySelectorAll('[data-plugin]:not(button)').forEach(e => {
      e.hidden = !!w.plugin && e.dataset.plugin !== w.plugin;
    });
    document.querySelectorAll('tr[data-freeze]').forEach(e => {
      e.hidden = !!w.freeze && e.dataset.freeze !== w.freeze;
    });
    document.querySelectorAll('.block,section.framework').forEach(e => {
      e.hidden = !e.querySelector('button.cell:not([hidden])');
    });
    document.getElementById('shown').textContent = shown + ' of ' + buttons.length + ' cells shown';
  }
  function add(dl, term, value) {
    if (value === undefined || value === null || value === '') return;
    dl.append(el('dt', term), el('dd', value));
  }
  function pre(parent, title, text) {
    if (text) parent.append(el('h3', title), el('pre', text));
  }
  function link(href) {
    const a = el('a', href);
    if (/^https?:\/\//.test(href)) { a.href = href; a.target = '_blank'; a.rel = 'noopener noreferrer'; }
    return a;
  }
  function show(id) {
    const c = data[id];
    if (!c) return;
    buttons.forEach(b => b.classList.toggle('active', b.dataset.id === id));
    body.replaceChildren(el('h2', id));
    const line = el('p');
    line.append(el('span', c.status, 'badge d-' + c.status));
    const shown = c.display === 'fixed?' ? 'fixed' : c.display;
    if (c.display !== c.status) line.append(el('span', c.display, 'badge d-' + shown));
    if (c.check) line.append(el('span', 'failed check: ' + c.check));
    body.append(line);
    const dl = el('dl', undefined, 'facts');
    ['model', 'framework', 'plugin', 'init', 'checkpoint', 'freeze', 'environment', 'precision', 'world_size']
      .forEach(k => add(dl, k, c[k]));
    const emulated = [];
    (c.rank_details || []).forEach(r => (r.emulated || []).forEach(x => {
      if (!emulated.includes(x)) emulated.push(x);
    }));
    const what = emulated.length ? ': ' + emulated.join('; ') : '';
    add(dl, 'emulation', c.emulation ? 'yes (CUDA-on-CPU shim)' + what : 'no');
    add(dl, 'grad access', c.grad_access);
    add(dl, 'grad norm source', c.grad_norm_source);
    if (c.duration_s !== undefined) add(dl, 'duration', c.duration_s + ' s');
    body.append(dl);
    pre(body, c.status === 'skip' ? 'reason' : 'message', c.message);
    if ((c.failures || []).length > 1) {
      const ul = el('ul');
      c.failures.forEach(f => {
        const li = el('li');
        li.append(el('strong', f.check + (f.step >= 0 ? ' (from step ' + f.step + ')' : '')));
        li.append(el('span', ': ' + f.message));
        if ((f.params || []).length) li.append(el('div', 'params: ' + f.params.join(', ')));
        ul.append(li);
      });
      body.append(el('h3', 'every failed check'), ul);
    }
    if (c.cause) add(dl, 'cause', c.cause);
    const k = c.known_issue;
    if (k && k.id) {
      body.append(el('h3', 'known issue'));
      const p = el('p');
      p.append(el('strong', k.id));
      if (k.summary) p.append(el('span', ' — ' + k.summary));
      const ul = el('ul');
      (k.links || (k.link ? [k.link] : [])).forEach(h => { const li = el('li'); li.append(link(h)); ul.append(li); });
      body.append(p, ul);
    }
    if ((c.notes || []).length) {
      const ul = el('ul');
      c.notes.forEach(n => ul.append(el('li', n)));
      body.append(el('h3', 'notes'), ul);
    }
    pre(body, 'reproduce', c.repro);
    (c.rank_details || []).forEach(r => {
      const box = el('div', undefined, 'rank');
      box.append(el('h3', 'rank ' + r.rank + ' — last phase: ' + r.phase));
      const facts = el('dl', undefined, 'facts');
      if (r.error) {
        add(facts, 'error', r.error.type + ': ' + r.error.message);
        add(facts, 'where', r.error.where);
        add(facts, 'phase', r.error.phase);
      }
      add(facts, 'exit', r.exit);
      if (r.emulated && r.emulated.length) add(facts, 'emulated', r.emulated.join('; '));
      box.append(facts);
      pre(box, 'traceback', r.traceback);
      pre(box, 'stack', r.stack);
      pre(box, 'log tail', r.log_tail);
      body.append(box);
    });
    panel.hidden = false;
    if (decodeURIComponent(location.hash.slice(1)) !== id) history.replaceState(null, '', '#' + encodeURIComponent(id));
  }
  function hide() {
    panel.hidden = true;
    buttons.forEach(b => b.classList.remove('active'));
    history.replaceState(null, '', location.pathname + location.search);
  }
  buttons.forEach(b => b.addEventListener('click', () => show(b.dataset.id)));
  selects.forEach(s => s.addEventListener('change', apply));
  document.getElementById('close').addEventListener('click', hide);
  document.addEventListener('keydown', e => { if (e.key === 'Escape') hide(); });
  apply();
  if (location.hash) show(decodeURIComponent(location.hash.slice(1)));
})();
