"""Rebuild austen.txt.gz (and austen_heldout.txt.gz) from Debian's r-cran-janeaustenr
package (see README.md).

  apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb x
  python make_corpus.py x/usr/lib/R/site-library/janeaustenr/data/Rdata austen.txt.gz austen_heldout.txt.gz

The novels sit in an R lazy-load database (.rdx index + .rdb blobs of R's XDR
serialisation); the tiny reader below handles just the types that file uses, so
rebuilding needs no R. Not imported by jaxpar.
"""
import gzip
import re
import struct
import sys
import zlib

# Four of the six novels: about 2.3 MB of text, under the 3 MB budget.
NOVELS = {
  "prideprejudice": "Pride and Prejudice",
  "sensesensibility": "Sense and Sensibility",
  "persuasion": "Persuasion",
  "northangerabbey": "Northanger Abbey",
}
# The held-out set (austen_heldout.txt.gz, `bundled-heldout`): Emma's first chapters.
HELDOUT = ("emma", "Emma", 6)
HEADING = re.compile(r"^(CHAPTER|Chapter) \S+$")


class _XDR:
  """Minimal reader for R's XDR serialisation format (version 2 and 3)."""

  def __init__(self, buf):
    self.buf, self.pos, self.refs = buf, 0, []

  def int(self):
    (v,) = struct.unpack(">i", self.buf[self.pos:self.pos + 4])
    self.pos += 4
    return v

  def read(self):
    assert self.buf[:2] == b"X\n", "not an XDR stream"
    self.pos = 2
    version = self.int()
    self.int(), self.int()
    if version == 3:
      n = self.int()  # native encoding name follows
      self.pos += n
    return self.item()

  def item(self):
    flags = self.int()
    kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
    if kind in (254, 242):  # NULL, empty env
      return None
    if kind == 255:  # reference to an earlier symbol
      idx = flags >> 8 or self.int()
      return self.refs[idx - 1]
    if kind == 1:  # symbol
      sym = ("sym", self.item())
      self.refs.append(sym)
      return sym
    if kind == 9:  # CHARSXP
      n = self.int()
      if n == -1:
        return None
      s = self.buf[self.pos:self.pos + n].decode("utf-8")
      self.pos += n
      return s
    if kind == 2:  # pairlist: attributes, tag, value, then the next cell
      out = []
      while True:
        if has_attr:
          self.item()
        tag = self.item() if has_tag else None
        out.append((tag, self.item()))
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:
          return dict((t[1], v) for t, v in out)
    n = self.int()
    if kind in (16, 19, 20):  # character vector, list, expression
      vals = [self.item() for _ in range(n)]
    elif kind in (10, 13):  # logical, integer
      vals = list(struct.unpack(f">{n}i", self.buf[self.pos:self.pos + 4 * n]))
      self.pos += 4 * n
    else:
      raise ValueError(f"R type {kind} not handled")
    attrs = self.item() if has_attr else {}
    return vals, attrs


def read_lazyload(base):
  index, attrs = _XDR(gzip.decompress(open(base + ".rdx", "rb").read())).read()
  variables = dict(zip(attrs["names"][0], index))["variables"]
  offsets, names = variables[0], variables[1]["names"][0]
  blob = open(base + ".rdb", "rb").read()
  out = {}
  for name, ((off, length), _) in zip(names, offsets):
    raw = zlib.decompress(blob[off + 4:off + length])  # 4-byte size, then zlib
    lines, _ = _XDR(raw).read()
    out[name] = [line or "" for line in lines]
  return out


def chapters(title, lines):
  """Split a novel at its chapter headings; unwrap each paragraph to one line."""
  docs, cur = [], None
  for line in lines:
    if line.strip() == "A NOTE ON THE TEXT":
      break  # a modern edition's note after Northanger Abbey: not Austen's text
    if HEADING.match(line.strip()):
      if cur is not None:
        docs.append(cur)
      cur = [line.strip()]
    elif cur is not None and not line.strip().upper().startswith("VOLUME"):
      cur.append(line)
  docs.append(cur)
  out = []
  for doc in docs:
    paras = re.split(r"\n\s*\n", "\n".join(doc[1:]).strip())
    paras = [" ".join(p.split()) for p in paras if p.strip()]
    out.append(f"{title}\n\n{doc[0]}\n\n" + "\n\n".join(paras))
  return out


def write(docs, dest):
  text = "\n\f\n".join(docs) + "\n"
  # no name and mtime=0 in the header, so the same input gives byte-identical output
  with open(dest, "wb") as f:
    with gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0, compresslevel=9) as gz:
      gz.write(text.encode("utf-8"))
  print(f"{len(docs)} documents, {len(text.encode())} bytes of text -> {dest}")


def main(base, dest, heldout_dest=None):
  novels = read_lazyload(base)
  write([d for key, title in NOVELS.items() for d in chapters(title, novels[key])], dest)
  if heldout_dest:  # text no bundled model trains on: the first chapters of another novel
    key, title, count = HELDOUT
    write(chapters(title, novels[key])[:count], heldout_dest)


if __name__ == "__main__":
  main(*sys.argv[1:4])
