#include "coordinator/agreement.h"

#include <algorithm>

#include "collectives/topology.h"

namespace gradsync::coordinator {

void OfferFold::add(const v1::ChannelOffer& offer, const std::string& who) {
  if (offer.rings() == 0 || !error_.empty()) return;
  if (offer.rings() > kMaxRings) {
    error_ = who + " offers " + std::to_string(offer.rings()) + " rings, outside 1.." + std::to_string(kMaxRings);
    return;
  }
  if (!any_) {
    any_ = true;
    slots_ = offer.slots();
    slot_bytes_ = offer.slot_bytes();
    first_who_ = who;
    smallest_ = offer.rings();
  } else if (offer.slots() != slots_ || offer.slot_bytes() != slot_bytes_) {
    error_ = who + " has channel geometry slots=" + std::to_string(offer.slots()) +
             " slot_bytes=" + std::to_string(offer.slot_bytes()) + " but " + first_who_ +
             " has slots=" + std::to_string(slots_) + " slot_bytes=" + std::to_string(slot_bytes_) +
             ": start every gradsyncd with the same --slots/--slot-bytes";
    return;
  }
  smallest_ = std::min(smallest_, offer.rings());
  if (offer.rings_chosen()) return;
  if (given_ != 0 && given_ != offer.rings()) {
    error_ = given_who_ + " was started with rings=" + std::to_string(given_) + " but " + who +
             " with rings=" + std::to_string(offer.rings()) +
             ": give every gradsyncd of a job the same --rings/GRADSYNC_NRINGS, or none (each then "
             "chooses from its cores and the job uses the smallest choice)";
    return;
  }
  given_ = offer.rings();
  given_who_ = who;
}

v1::JobAgreement OfferFold::result() const {
  v1::JobAgreement out;
  out.set_rings(given_ ? given_ : any_ ? smallest_ : 1);
  out.set_error(error_);
  return out;
}

}  // namespace gradsync::coordinator
