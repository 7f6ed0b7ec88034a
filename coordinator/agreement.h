// The channel agreement of one generation (ring count, slot geometry), folded join by join so
// that no node needs every other node's offer: O(1) per join, one JobAgreement per table.
#pragma once

#include <cstdint>
#include <string>

#include "coordinator.pb.h"

namespace gradsync::coordinator {

class OfferFold {
 public:
  // `who` names the offering node for errors: "node n1-3 (host b)". An offer with rings 0
  // (a client that sends none) is ignored.
  void add(const v1::ChannelOffer& offer, const std::string& who);
  // The ring count the nodes were given where any was given (they must agree), else the
  // smallest count any node chose; 1 without offers. `error` names the first conflict.
  v1::JobAgreement result() const;

 private:
  bool any_ = false;
  uint32_t slots_ = 0, slot_bytes_ = 0;
  std::string first_who_;
  uint32_t given_ = 0;
  std::string given_who_;
  uint32_t smallest_ = 0;
  std::string error_;
};

}  // namespace gradsync::coordinator
