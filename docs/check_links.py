"""Checks README.md and docs/*.md: every relative link and image resolves to a file, every
#anchor to a heading of its target (GitHub's slug rule), and every repository path quoted in
backticks (`tlt_jax/...`, `scripts/...`, ...) exists, so a moved section or a renamed module
cannot leave a dead reference behind.

  python docs/check_links.py        # prints each broken reference; exit status 1 if any
"""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(tlt_jax|scripts|configs|tests|notebooks|docs)/[\w./-]*$")


def slug(heading: str) -> str:
  # GitHub: lower case, drop punctuation except '-' and '_', spaces become '-'
  text = re.sub(r"`", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(path: str) -> list[str]:
  """The file's lines outside fenced code blocks (a '#' in a bash block is no heading)."""
  lines, fenced = [], False
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.lstrip().startswith("```"):
        fenced = not fenced
      elif not fenced:
        lines.append(line.rstrip("\n"))
  return lines


def anchors(path: str) -> set[str]:
  return {slug(m.group(1)) for line in prose(path) if (m := re.match(r"#+\s+(.*)", line))}


def problems(path: str) -> list[str]:
  out = []
  text = "\n".join(prose(path))
  for target in LINK.findall(text):
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
      continue
    file, _, anchor = target.partition("#")
    dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
    if not os.path.exists(dest):
      out.append(f"{target}: no such file")
    elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
      out.append(f"{target}: no heading with anchor #{anchor}")
  for span in CODE.findall(text):
    if REPO_PATH.match(span) and not os.path.exists(os.path.join(ROOT, span)):
      out.append(f"`{span}`: no such path in the repository")
  return out


def main() -> int:
  files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
  bad = 0
  for path in files:
    for p in problems(path):
      print(f"{os.path.relpath(path, ROOT)}: {p}")
      bad += 1
  print(f"{len(files)} files checked, {bad} broken references")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
