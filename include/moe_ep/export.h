// Symbol visibility: the library builds with -fvisibility=hidden and exports only what carries
// MOE_EP_API.
#pragma once

#if defined(MOE_EP_STATIC)
#define MOE_EP_API
#elif defined(MOE_EP_BUILDING)
#define MOE_EP_API __attribute__((visibility("default")))
#else
#define MOE_EP_API
#endif
