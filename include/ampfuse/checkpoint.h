#pragma once
// Checking a checkpoint file's container before torch::load reads it.
//
// torch::save writes a zip archive and stores a CRC-32 of every record.
// LibTorch's reader checks none of them, and reads a record whose entry
// says "directory" as empty without writing the buffer it allocated for it:
// a file damaged in its tensors' bytes loads with those bytes, and one
// damaged in that attribute loads tensors of unwritten memory. No load()
// can tell either from data, since it gets the tensors after the bytes are
// gone. verify_checkpoint reads the file first:
//
//   ampfuse::verify_checkpoint(path);  // throws c10::Error naming the record
//   torch::load(optimizer, path);
//
// or, in one call that reads the file it checked (one open file, so a file
// replaced at `path` in between cannot be loaded unchecked):
//
//   ampfuse::load_checkpoint(optimizer, path);
//
// It checks the archive's layout (the end records, zip64 included, and the
// central directory within the file), every entry (not a directory, a local
// header at its offset with the same name, its bytes within the file, no
// name twice) and the CRC-32 of every stored record (all of a tensor's
// bytes: torch::save stores them uncompressed; a file written with CRC-32s
// off, which records 0 for each, has its layout checked). Compressed
// records (the TorchScript source LibTorch writes beside the data, which
// its reader parses and refuses when damaged) have their layout checked and
// their inflated size bounded by what deflate can reach (LibTorch's reader
// allocates that size before inflating), not their CRC-32. It reads the
// whole file once.

#include <torch/serialize.h>

#include <fstream>
#include <istream>
#include <string>

namespace ampfuse {

/// Throws c10::Error, naming the record and what is wrong, unless `in`
/// holds an archive as torch::save writes it whose records are intact. The
/// whole stream is read, from its start, as torch::load reads it; its
/// position is put back.
void verify_checkpoint(std::istream& in);

/// The same for the file at `path`.
void verify_checkpoint(const std::string& path);

/// verify_checkpoint(in), then torch::load(value, in): anything torch::load
/// takes (an optimizer, a GradScaler, a module) is loaded from `in` only when
/// its archive is intact, and is untouched when it is not. The bytes checked
/// are the bytes loaded.
template <typename Value>
void load_checkpoint(Value& value, std::istream& in) {
  verify_checkpoint(in);
  torch::load(value, in);
}

/// The same for the file at `path`, opened once for both.
template <typename Value>
void load_checkpoint(Value& value, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.is_open(), "ampfuse::load_checkpoint: cannot open ", path);
  load_checkpoint(value, in);
}

}  // namespace ampfuse
