// ampfuse/checkpoint.h: a checkpoint file's zip container, checked before
// torch::load reads it (the zip format: PKWARE's APPNOTE, sections 4.3 and
// 4.4; zip64 records where torch::save writes them).

#include "ampfuse/checkpoint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <set>
#include <vector>

namespace ampfuse {
namespace {

// The little-endian number of `bytes` bytes at p, whatever the processor's order.
std::uint64_t le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// CRC-32 (the zip polynomial, reflected), eight bytes a step: table[k][b]
// is the CRC of byte b followed by k zero bytes.
struct Crc32Tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  Crc32Tables() {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
      t[0][b] = c;
    }
    for (std::uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
};

std::uint32_t crc32_update(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  static const Crc32Tables tables;
  const auto& t = tables.t;
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    const auto lo = static_cast<std::uint32_t>(le(p, 4)) ^ crc, hi = static_cast<std::uint32_t>(le(p + 4, 4));
    crc = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFFu];
  return ~crc;
}

constexpr char kWhat[] = "verify_checkpoint: ";
constexpr std::uint32_t kLocal = 0x04034b50, kCentral = 0x02014b50, kEnd = 0x06054b50, kEnd64 = 0x06064b50,
                        kLocator64 = 0x07064b50;

// The bytes [begin, begin + size) of the file, read from `in` (positions
// relative to `base`, where the file starts in the stream).
class File {
 public:
  File(std::istream& in, std::streamoff base, std::uint64_t size) : in_(in), base_(base), size_(size) {}
  std::uint64_t size() const { return size_; }
  std::vector<unsigned char> read(std::uint64_t begin, std::uint64_t size, const char* what) {
    TORCH_CHECK(begin <= size_ && size <= size_ - begin, kWhat, what, " lies past the end of the file (",
                size_, " bytes): the file is truncated or damaged");
    std::vector<unsigned char> bytes(size);
    in_.seekg(base_ + static_cast<std::streamoff>(begin));
    in_.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
    TORCH_CHECK(in_.gcount() == static_cast<std::streamsize>(size), kWhat, "reading ", what, " failed");
    return bytes;
  }
  // CRC-32 of [begin, begin + size), read in pieces.
  std::uint32_t crc(std::uint64_t begin, std::uint64_t size, const std::string& what) {
    TORCH_CHECK(begin <= size_ && size <= size_ - begin, kWhat, what, " lies past the end of the file");
    in_.seekg(base_ + static_cast<std::streamoff>(begin));
    std::vector<char> piece(std::min<std::uint64_t>(size, std::uint64_t{1} << 22));
    std::uint32_t crc = 0;
    for (std::uint64_t left = size; left > 0;) {
      const auto n = static_cast<std::streamsize>(std::min<std::uint64_t>(left, piece.size()));
      in_.read(piece.data(), n);
      TORCH_CHECK(in_.gcount() == n, kWhat, "reading ", what, " failed");
      crc = crc32_update(crc, reinterpret_cast<const unsigned char*>(piece.data()), static_cast<std::size_t>(n));
      left -= static_cast<std::uint64_t>(n);
    }
    return crc;
  }

 private:
  std::istream& in_;
  std::streamoff base_;
  std::uint64_t size_;
};

struct Directory {
  std::uint64_t entries = 0, offset = 0, size = 0;
};

// The end of central directory record (and the zip64 one it points to).
Directory find_directory(File& file) {
  constexpr std::uint64_t kEndSize = 22, kMaxComment = 0xFFFF;
  TORCH_CHECK(file.size() >= kEndSize, kWhat, "the file has ", file.size(),
              " bytes: too short for a zip archive (truncated, or not a checkpoint?)");
  const std::uint64_t tail = std::min(file.size(), kEndSize + kMaxComment);
  const std::vector<unsigned char> t = file.read(file.size() - tail, tail, "the end of the archive");
  std::uint64_t at = tail - kEndSize + 1;
  do {
    --at;
  } while (at > 0 && le(&t[at], 4) != kEnd);
  TORCH_CHECK(le(&t[at], 4) == kEnd, kWhat,
              "the file has no end of central directory record: it is not a zip archive, or it is truncated");
  const std::uint64_t end = file.size() - tail + at;
  Directory d{le(&t[at + 10], 2), le(&t[at + 16], 4), le(&t[at + 12], 4)};
  if (end >= 20 && le(&file.read(end - 20, 4, "the zip64 locator")[0], 4) == kLocator64) {
    const std::vector<unsigned char> locator = file.read(end - 20, 20, "the zip64 locator");
    const std::uint64_t at64 = le(&locator[8], 8);
    const std::vector<unsigned char> e = file.read(at64, 56, "the zip64 end of central directory record");
    TORCH_CHECK(le(&e[0], 4) == kEnd64, kWhat, "the zip64 locator points at offset ", at64,
                ", which holds no zip64 end of central directory record (a damaged file?)");
    d = {le(&e[32], 8), le(&e[48], 8), le(&e[40], 8)};
  }
  TORCH_CHECK(d.offset <= file.size() && d.size <= file.size() - d.offset, kWhat, "the central directory (",
              d.size, " bytes at offset ", d.offset, ") lies outside the file of ", file.size(),
              " bytes (a damaged file?)");
  return d;
}

void verify(File& file) {
  const Directory d = find_directory(file);
  const std::vector<unsigned char> cd = file.read(d.offset, d.size, "the central directory");
  std::set<std::string> names;
  struct Stored {
    std::string record;
    std::uint64_t data, size;
    std::uint32_t crc;
  };
  std::vector<Stored> stored;  // records stored uncompressed: their CRC-32s are checked once the layout is
  bool recorded = false;       // whether any record of some bytes has a CRC-32 other than 0
  std::uint64_t at = 0;
  for (std::uint64_t k = 0; k < d.entries; ++k) {
    constexpr std::uint64_t kFixed = 46;
    TORCH_CHECK(at + kFixed <= cd.size() && le(&cd[at], 4) == kCentral, kWhat, "entry ", k, " of ", d.entries,
                " of the central directory is damaged or missing");
    const unsigned char* e = &cd[at];
    const std::uint64_t name_size = le(e + 28, 2), extra_size = le(e + 30, 2), comment_size = le(e + 32, 2);
    TORCH_CHECK(at + kFixed + name_size + extra_size + comment_size <= cd.size(), kWhat, "entry ", k,
                " of the central directory runs past its end (a damaged file?)");
    const std::string name(reinterpret_cast<const char*>(e + kFixed), name_size);
    const std::string record = "record '" + name + "'";
    const std::uint64_t method = le(e + 10, 2), crc = le(e + 16, 4);
    std::uint64_t compressed = le(e + 20, 4), size = le(e + 24, 4), local = le(e + 42, 4);
    // The zip64 extra field holds the 64-bit values of those that read all ones, in this order.
    for (std::uint64_t x = 0; x + 4 <= extra_size;) {
      const unsigned char* f = e + kFixed + name_size + x;
      const std::uint64_t id = le(f, 2), field_size = le(f + 2, 2);
      TORCH_CHECK(x + 4 + field_size <= extra_size, kWhat, record, ": its extra field is damaged");
      if (id == 0x0001) {
        std::uint64_t o = 4;
        for (std::uint64_t* v : {&size, &compressed, &local}) {
          if (*v != 0xFFFFFFFFu) continue;
          TORCH_CHECK(o + 8 <= 4 + field_size, kWhat, record, ": its zip64 field is too short");
          *v = le(f + o, 8);
          o += 8;
        }
      }
      x += 4 + field_size;
    }
    TORCH_CHECK(!name.empty(), kWhat, "entry ", k, " of the central directory has no name (a damaged file)");
    TORCH_CHECK(name.back() != '/' && (le(e + 38, 4) & 0x10u) == 0, kWhat, record,
                " is marked as a directory: LibTorch's reader would leave its bytes unwritten (a damaged file)");
    TORCH_CHECK(names.insert(name).second, kWhat, record, " appears twice in the central directory (a damaged file?)");
    TORCH_CHECK(method == 0 || method == 8, kWhat, record, " is stored with compression method ", method,
                ", which torch::save does not write (a damaged file?)");
    TORCH_CHECK(method != 0 || compressed == size, kWhat, record, " is stored uncompressed but its sizes differ (",
                compressed, " and ", size, " bytes; a damaged file?)");
    // Deflate expands at most 1032-fold: a larger size read from a damaged
    // entry would have LibTorch's reader allocate it before inflating.
    TORCH_CHECK(method != 8 || size / 1032 <= compressed + 1, kWhat, record, " says ", compressed,
                " compressed bytes inflate to ", size, ", more than deflate can (a damaged file)");
    const std::vector<unsigned char> h = file.read(local, 30, ("the local header of " + record).c_str());
    const std::uint64_t local_name = le(&h[26], 2), local_extra = le(&h[28], 2);
    TORCH_CHECK(le(&h[0], 4) == kLocal && local_name == name_size &&
                    file.read(local + 30, local_name, ("the name of " + record).c_str()) ==
                        std::vector<unsigned char>(name.begin(), name.end()),
                kWhat, record, ": no local header of that name at offset ", local, " (a damaged file?)");
    const std::uint64_t data = local + 30 + local_name + local_extra;
    TORCH_CHECK(data <= d.offset && compressed <= d.offset - data, kWhat, record, " (", compressed,
                " bytes at offset ", data, ") runs into the central directory or past the file's end (a damaged file?)");
    recorded = recorded || (size > 0 && crc != 0);
    if (method == 0 && compressed > 0) stored.push_back({record, data, compressed, static_cast<std::uint32_t>(crc)});
    at += kFixed + name_size + extra_size + comment_size;
  }
  // A file written with CRC-32s off (Python's torch.serialization.config.save.compute_crc32 = False)
  // records 0 for every record: its layout is all there is to check.
  for (const Stored& r : stored) {
    if (!recorded) break;
    const std::uint32_t got = file.crc(r.data, r.size, r.record);
    TORCH_CHECK(got == r.crc, kWhat, r.record, " has CRC-32 ", got, " but the archive recorded ", r.crc,
                " when it was written: its bytes are damaged");
  }
}

}  // namespace

void verify_checkpoint(std::istream& in) {
  TORCH_CHECK(!in.bad() && !in.fail(), kWhat, "the stream cannot be read");
  in.clear();  // an end-of-file flag alone: seeking clears it, as LibTorch's reader seeks
  const std::streampos start = in.tellg();
  TORCH_CHECK(start >= 0, kWhat, "the stream cannot seek (a file or memory stream is needed)");
  // However it ends, the stream is left readable where it was.
  struct Restore {
    std::istream& in;
    std::streampos start;
    ~Restore() {
      try {
        in.clear();
        in.seekg(start);
      } catch (...) {  // a stream that throws on failure: it stays where the failure left it
      }
    }
  } restore{in, start};
  in.seekg(0, std::ios::end);
  const std::streampos end = in.tellg();
  TORCH_CHECK(end >= 0, kWhat, "the stream cannot seek to its end (a file or memory stream is needed)");
  File file(in, 0, static_cast<std::uint64_t>(end));  // the whole stream, as LibTorch's reader takes it
  verify(file);
}

void verify_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.is_open(), kWhat, "cannot open ", path);
  verify_checkpoint(in);
}

}  // namespace ampfuse
