// Stand-in for Apple's <objc/message.h> (not on Linux): the message-send entry points metal-cpp casts.
#pragma once

#include <objc/runtime.h>

// Declared without prototypes as in the SDK (OBJC_OLD_DISPATCH_PROTOTYPES=0); callers cast them.
extern "C" {
void objc_msgSend(void);
void objc_msgSend_stret(void);  // x86-64 only in the SDK; metal-cpp names it off arm64
void objc_msgSend_fpret(void);  // x86-64 only in the SDK
}
