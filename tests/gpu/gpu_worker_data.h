// The data of the GPU trainer process (gpu_worker.cc): inputs whose reductions are exact in
// every type and order, the expected results, and the report of a differing element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"

namespace gpu_worker {

using gradsync::DataType;
using gradsync::ReduceOp;

inline const DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                           DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
inline const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg};

std::vector<size_t> parse_counts(const std::string& s);

// Small integers per (rank, index, op), chosen so that every reduction is exact in every type.
double value(int rank, size_t i, ReduceOp op, bool is_unsigned);

void store(DataType t, void* base, size_t i, double v);

void fill(DataType t, ReduceOp op, int rank, size_t count, std::vector<uint8_t>* buf);

// The expected result: rank 0's input folded with every other rank's in rank order, the last
// step dividing for avg (host loops; exact inputs make the order irrelevant anyway).
std::vector<uint8_t> expected(DataType t, ReduceOp op, int world, size_t count);

double decode(DataType t, const uint8_t* p);

// "0x3c00 (1)": an element's bits and value.
std::string element_str(DataType t, const uint8_t* p);

// What a call was, for failure messages: "reduce_scatter float16 op=sum count=1000 in-place,
// rank 1 of 2 (path cuda-ipc)".
std::string label(gradsync::Communicator& comm, const char* collective, DataType t,
                  const std::string& extra, size_t count, const char* placement);

// 0 when got equals want bit for bit (count elements); else prints the first difference, how
// many elements differ and the last one, and returns 1.
int compare(const std::string& what, const char* buffer, DataType t, const uint8_t* got,
            const uint8_t* want, size_t count);

// Arbitrary bits per (rank, element): NaNs, infinities, subnormals and all; the copying
// collectives must move them unchanged, and every rank's differ.
void fill_bits(DataType t, int rank, size_t count, uint8_t* out);

// A refusal: kInvalidArgument, and the message names the rank and its host.
int expect_refused(const char* what, const gradsync::Status& s);

}  // namespace gpu_worker
